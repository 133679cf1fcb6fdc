"""A demo language model to lower and run: a small byte-level decoder with a static KV cache.

Exported as two methods, ``prefill`` and ``decode``, that share every weight and the cache:
the case torchdelegate is built for, without downloading a model. The shipped weights were
trained on a public-domain novel; :func:`build_demo_model` gives random, deterministic ones
(from a seed, never the global RNG) for any size. See :mod:`torchdelegate.demo.model`.

    model = trained_demo_model()
    programs = export_demo(model, prompt_len=8)   # {"prefill": ..., "decode": ...}
    lowered = torchdelegate.to_edge(programs).to_backend([OnnxRuntimePartitioner(), ReferencePartitioner()])
    lowered.save("demo.tdp")
    with torchdelegate.load("demo.tdp") as program:
        tokens = generate(program.method("prefill"), program.method("decode"), prompt, new_tokens=16)
"""

from torchdelegate.demo.model import (
    DecoderLM,
    DemoConfig,
    build_demo_model,
    export_demo,
    generate,
    reset_cache,
    trained_demo_model,
)

__all__ = [
    "DecoderLM",
    "DemoConfig",
    "build_demo_model",
    "export_demo",
    "generate",
    "reset_cache",
    "trained_demo_model",
]
