"""The Megatron side: the Megatron-Bridge target and its preflight, the fixes the pinned versions
need on real machines, and the CPU dry run that trains a tiny megatron-core GPT over gloo."""
