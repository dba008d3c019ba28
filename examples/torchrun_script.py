"""A plain torchrun program: it knows nothing of Ray. Run it either way, unchanged:

    torchrun --nproc-per-node 2 examples/torchrun_script.py --steps 3
    python main.py --nodes 1 --gpus-per-node 2 examples/torchrun_script.py --steps 3
    python main.py --device cpu --gpus-per-node 2 examples/torchrun_script.py --steps 3   # no GPU: gloo

Each rank selects its GPU with LOCAL_RANK, joins the process group from the env contract, and
all-reduces its rank; every rank must print the same sum.
"""

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "x") != ""
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    for _ in range(args.steps):
        t = torch.tensor([float(rank)], device=device)
        dist.all_reduce(t)
    where = torch.cuda.get_device_name(device) if use_cuda else "cpu"
    print(
        f"rank {rank}/{world} local_rank {os.environ['LOCAL_RANK']} "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} device={device} ({where}) "
        f"sum={t.item():g} expected={world * (world - 1) / 2:g}",
        flush=True,
    )
    assert t.item() == world * (world - 1) / 2
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
