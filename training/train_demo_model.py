"""Train the demo model on ``botchan.txt`` and write the weights the package ships.

    .venv/bin/python training/train_demo_model.py   # writes src/torchdelegate/demo/weights.pt

Run once; the weights are committed. The text is Natsume Soseki's *Botchan* in Yasotaro
Morri's 1919 English translation, in the public domain (Project Gutenberg eBook #8868, its
header and licence removed). Training is deterministic for a seed on one machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from torchdelegate.demo.model import DEMO_WEIGHTS, build_demo_model, save_demo_weights
from torchdelegate.demo.training import TrainingPlan, train

TEXT = Path(__file__).with_name("botchan.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=TrainingPlan.steps)
    parser.add_argument("--output", type=Path, default=DEMO_WEIGHTS)
    args = parser.parse_args()
    torch.manual_seed(0)  # dropout-free model; this only fixes torch's own kernels' choices
    model = build_demo_model()
    plan = TrainingPlan(steps=args.steps)
    report = train(model, TEXT.read_bytes(), plan, lambda step, loss: print(f"step {step}: loss {loss:.3f}"))
    print(
        f"trained {report.steps} steps in {report.seconds:.0f} s: loss {report.train_loss:.3f}, "
        f"held-out loss {report.held_out_loss:.3f} nats per byte"
    )
    save_demo_weights(model, args.output)
    print(f"wrote {args.output} ({args.output.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
