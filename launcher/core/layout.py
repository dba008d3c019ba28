"""Does a Megatron parallel layout fit the requested world? Checked in the driver, before any GPU.

Megatron finds most of these itself, but only after every rank has been placed, has imported
Megatron and has joined the process group; one rank then raises and the others hang. Each message
prints the numbers and says which setting to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelDims:
    """The model-parallel sizes of a world (torchtitan's `ParallelDims`): tensor, pipeline and context
    parallel; data parallel is what the world leaves (`dp`). A rank's coordinates come from them
    (core/metrics.py `coordinates`)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self):
        if min(self.tp, self.pp, self.cp) < 1:
            raise ValueError(f"TP {self.tp}, PP {self.pp} and CP {self.cp} must each be at least 1")

    def dp(self, world: int) -> int | None:
        """The data-parallel size of `world` ranks; None where TP x PP x CP does not divide it."""
        model = self.tp * self.pp * self.cp
        return None if world % model else world // model


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None means TP
    global_batch: int = 1
    micro_batch: int = 1
    num_heads: int | None = None
    num_query_groups: int | None = None
    num_experts: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> Layout:
        """Read a Megatron-Bridge ConfigContainer."""
        m, t = cfg.model, cfg.train
        return cls(
            tp=m.tensor_model_parallel_size or 1,
            pp=m.pipeline_model_parallel_size or 1,
            cp=getattr(m, "context_parallel_size", 1) or 1,
            ep=getattr(m, "expert_model_parallel_size", 1) or 1,
            etp=getattr(m, "expert_tensor_parallel_size", None),
            global_batch=t.global_batch_size,
            micro_batch=t.micro_batch_size,
            num_heads=getattr(m, "num_attention_heads", None),
            num_query_groups=getattr(m, "num_query_groups", None),
            num_experts=getattr(m, "num_moe_experts", None),
        )

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.tp, self.pp, self.cp)

    def describe(self) -> str:
        etp = self.tp if self.etp is None else self.etp
        return (
            f"TP {self.tp} x PP {self.pp} x CP {self.cp}, EP {self.ep} (expert TP {etp}), "
            f"global batch {self.global_batch}, micro batch {self.micro_batch}"
        )


def layout_problems(layout: Layout, nodes: int, gpus_per_node: int) -> list[str]:
    """Every way `layout` does not fit `nodes` x `gpus_per_node` ranks; empty when it fits."""
    world = nodes * gpus_per_node
    where = f"world size {world} (--nodes {nodes} x --gpus-per-node {gpus_per_node})"
    out: list[str] = []
    tp, pp, cp, ep = layout.tp, layout.pp, layout.cp, layout.ep
    etp = tp if layout.etp is None else layout.etp
    model_parallel = tp * pp * cp
    if world % model_parallel:
        out.append(
            f"TP {tp} x PP {pp} x CP {cp} = {model_parallel} does not divide {where}; change "
            "model.tensor_model_parallel_size / pipeline_model_parallel_size / context_parallel_size or the "
            "number of ranks"
        )
    dp = max(world // model_parallel, 1)
    if tp > gpus_per_node or gpus_per_node % tp:
        out.append(
            f"TP {tp} must fit within one node of {gpus_per_node} GPUs (and divide it): tensor parallelism "
            "needs NVLink; lower model.tensor_model_parallel_size or raise --gpus-per-node"
        )
    if ep > 1 or etp != tp:
        expert_mp = etp * ep * pp
        if world % expert_mp:
            out.append(
                f"expert TP {etp} x EP {ep} x PP {pp} = {expert_mp} does not divide {where}; change "
                "model.expert_model_parallel_size or model.expert_tensor_parallel_size"
            )
        if layout.num_experts is not None and layout.num_experts % ep:
            out.append(
                f"EP {ep} does not divide the {layout.num_experts} experts; set "
                "model.expert_model_parallel_size to a divisor of model.num_moe_experts"
            )
    if layout.micro_batch < 1 or layout.global_batch % (layout.micro_batch * dp):
        out.append(
            f"global batch {layout.global_batch} is not a multiple of micro batch {layout.micro_batch} x "
            f"DP {dp} = {layout.micro_batch * dp}; change train.global_batch_size or train.micro_batch_size"
        )
    if layout.num_heads is not None and layout.num_heads % tp:
        out.append(
            f"TP {tp} does not divide the {layout.num_heads} attention heads; change "
            "model.tensor_model_parallel_size"
        )
    if layout.num_query_groups is not None and layout.num_query_groups % tp:
        out.append(
            f"TP {tp} does not divide the {layout.num_query_groups} query groups (KV heads); change "
            "model.tensor_model_parallel_size"
        )
    return out
