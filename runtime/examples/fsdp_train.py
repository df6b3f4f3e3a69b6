"""Train a catalogue model with PyTorch FSDP2 (``fully_shard``) on CPUs (gloo) for a few steps.

    torchrun --nproc-per-node 2 -m runtime.examples.fsdp_train --model tiny --steps 3 --seq 16

Each transformer layer is its own FSDP unit, then the whole model (so embeddings and
the LM head form the root unit), as FSDP users shard a transformer. Used under
``commsim record`` to check that recording sees FSDP's collectives as it sees
DeepSpeed's: parameter all-gathers per unit (forward, and again in backward with
``reshard_after_forward``) and gradient reduce-scatters.
"""

from __future__ import annotations

import argparse
import datetime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from commsim.models import resolve_model
    from runtime.torch_models import build_model

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    cfg = resolve_model(args.model)
    model = build_model(cfg)
    for layer in model.roberta.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    for _ in range(args.steps):
        ids = torch.randint(0, cfg.vocab, (args.micro_batch, args.seq), generator=g)
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
