"""The demo language model: deterministic, and lowered to ONNX Runtime it generates eager's tokens."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torchdelegate as td
from torchdelegate.demo import DemoConfig, build_demo_model, export_demo, generate, reset_cache

PROMPT = torch.tensor([list(b"Hello, w")])  # 8 bytes
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lowered() -> td.EdgeProgramManager:
    """The demo's two methods lowered with ONNX Runtime first, the reference backend for the rest."""
    pytest.importorskip("onnxruntime")
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
    from torchdelegate.backends.reference import ReferencePartitioner

    programs = export_demo(build_demo_model(), prompt_len=PROMPT.shape[1])
    return td.to_edge(programs).to_backend([OnnxRuntimePartitioner(), ReferencePartitioner()])


@pytest.fixture(scope="module")
def program(lowered: td.EdgeProgramManager, tmp_path_factory: pytest.TempPathFactory) -> Iterator[td.Program]:
    path = tmp_path_factory.mktemp("demo") / "demo.tdp"
    lowered.save(path)
    with td.load(path) as loaded:
        yield loaded


def test_the_loaded_program_generates_eagers_tokens_and_logits(program: td.Program) -> None:
    eager = build_demo_model()
    expected = generate(eager.prefill, eager.decode, PROMPT, NEW_TOKENS, max_len=eager.config.max_len)
    prefill, decode = program.method("prefill"), program.method("decode")
    assert generate(prefill, decode, PROMPT, NEW_TOKENS) == expected

    # Logits of prefill and of the first decode step: decode reads the cache prefill wrote.
    position, token = torch.tensor([PROMPT.shape[1]]), torch.tensor([[expected[0]]])
    with torch.no_grad():
        expected_logits = [eager.prefill(PROMPT), eager.decode(token, position)]
    got = [prefill(PROMPT), decode(token, position)]
    for got_logits, want in zip(got, expected_logits, strict=True):
        assert got_logits.shape == (1, eager.config.vocab_size)
        torch.testing.assert_close(got_logits, want, atol=1e-4, rtol=1e-4)


def test_onnxruntime_takes_every_computation_of_both_methods(lowered: td.EdgeProgramManager) -> None:
    per_backend = {m: Counter(d.backend_id for d in ds) for m, ds in lowered.delegates().items()}
    sizes = {
        m: [sum(n.op == "call_function" for n in d.original_module.graph.nodes) for d in ds]
        for m, ds in lowered.delegates().items()
    }
    print(f"\ndelegates per backend: {per_backend}; nodes per delegate: {sizes}")
    # One ONNX Runtime delegate per method, the KV cache update (index_put -> ScatterND) included:
    # nothing is left for the reference backend, and nothing runs outside a delegate.
    assert per_backend == {"prefill": Counter(onnxruntime=1), "decode": Counter(onnxruntime=1)}
    for method in lowered.methods:
        residual = {str(n.target) for n in lowered.exported_program(method).graph.nodes if n.op == "call_function"}
        assert residual <= {"torchdelegate_call_delegate", "<built-in function getitem>"}, (method, residual)
        assert sizes[method][0] > 200  # the whole method: every layer's attention, MLP and cache writes


def test_the_model_is_deterministic_and_export_leaves_it_unchanged() -> None:
    rng = torch.random.get_rng_state()
    first, second = build_demo_model(), build_demo_model()
    assert torch.equal(rng, torch.random.get_rng_state())  # a local generator: the global RNG is untouched
    state = first.state_dict()
    assert state.keys() == second.state_dict().keys()
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in state.items())
    assert not torch.equal(build_demo_model(seed=1).head.weight, first.head.weight)

    generate(first.prefill, first.decode, PROMPT, 4)  # a cache that is not empty
    before = {k: v.clone() for k, v in first.state_dict().items()}
    programs = export_demo(first, prompt_len=PROMPT.shape[1])
    assert all(torch.equal(v, before[k]) for k, v in first.state_dict().items())
    prefill, decode = programs["prefill"].state_dict, programs["decode"].state_dict
    for name in ("model.k_cache_0", "model.v_cache_3"):  # both methods hold one fresh cache, not the model's
        assert prefill[name] is decode[name]
        assert prefill[name] is not first.get_buffer(name.removeprefix("model."))
        assert not prefill[name].any()
    assert prefill["model.tok_emb.weight"] is first.tok_emb.weight  # parameters are shared, not copied

    reset_cache(first)
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())


def test_exported_programs_run_like_the_model_and_greedy_generation_is_varied() -> None:
    model = build_demo_model()
    programs = export_demo(model, prompt_len=PROMPT.shape[1])
    expected = generate(model.prefill, model.decode, PROMPT, 32)
    assert len(set(expected)) >= 8, expected  # random weights, yet not one token over and over
    # Before any lowering: the two programs share their cache, as torch.export left them.
    assert generate(programs["prefill"].module(), programs["decode"].module(), PROMPT, 12) == expected[:12]


def test_generate_refuses_what_the_cache_cannot_hold() -> None:
    config = DemoConfig(max_len=16, n_layers=1)
    model = build_demo_model(config)
    assert len(generate(model.prefill, model.decode, PROMPT, 9, max_len=16)) == 9  # writes positions 0..15
    with pytest.raises(ValueError, match="exceeds the cache"):
        generate(model.prefill, model.decode, PROMPT, 10, max_len=16)
    with pytest.raises(ValueError, match="prompt_len"):
        export_demo(model, prompt_len=16)


TRAINING_TEXT = Path(__file__).parents[2] / "training" / "botchan.txt"


def test_the_shipped_weights_fit_the_budget_and_their_greedy_output_reads_as_text() -> None:
    """At most 4 MB in the package; greedy text from a prompt not in the book is made of the book's words."""
    from torchdelegate.demo.model import DEMO_WEIGHTS, trained_demo_model

    assert DEMO_WEIGHTS.stat().st_size <= 4_000_000
    model = trained_demo_model()
    prompt = torch.tensor([list(b"torchdelegate is")])
    text = bytes(generate(model.prefill, model.decode, prompt, 80, max_len=model.config.max_len)).decode("ascii")
    assert text.isprintable() or all(c.isprintable() or c == "\n" for c in text)
    words = re.findall(r"[a-z]+", text.lower())
    known = set(re.findall(r"[a-z]+", TRAINING_TEXT.read_text().lower()))
    assert len(words) >= 10 and sum(w in known for w in words) >= 0.8 * len(words), text


def test_training_computes_what_the_cached_forward_computes() -> None:
    """The training forward (whole windows, no cache) gives the exported forward's logits, so trained
    weights run unchanged in prefill and decode."""
    from torchdelegate.demo.model import trained_demo_model
    from torchdelegate.demo.training import window_logits

    model = trained_demo_model()
    tokens = torch.tensor([list(b"The teacher said that he was")])
    with torch.no_grad():
        windows = window_logits(model, tokens)
        for end in (5, tokens.shape[1]):
            reset_cache(model)
            torch.testing.assert_close(windows[:, end - 1], model.prefill(tokens[:, :end]), atol=1e-4, rtol=1e-4)


def test_training_lowers_the_held_out_loss_and_the_weights_round_trip(tmp_path: Path) -> None:
    from torchdelegate.demo.model import save_demo_weights, trained_demo_model
    from torchdelegate.demo.training import TrainingPlan, held_out_loss, train

    model = build_demo_model(DemoConfig(d_model=32, n_layers=1, n_heads=2, max_len=16))
    text = TRAINING_TEXT.read_bytes()[:20_000]
    data = torch.frombuffer(bytearray(text[19_000:]), dtype=torch.uint8).long()
    before = held_out_loss(model, data)
    report = train(model, text, TrainingPlan(steps=60, batch=8, warmup=10))
    assert report.held_out_loss < before - 1.0 and not model.training
    with pytest.raises(ValueError, match="too short"):
        train(model, text[:100], TrainingPlan(steps=1))
    path = tmp_path / "weights.pt"
    save_demo_weights(trained_demo_model(), path)
    assert torch.equal(trained_demo_model(path).head.weight, trained_demo_model().head.weight)
    torch.save({"head.weight": torch.zeros(256, 128)}, path)
    with pytest.raises(ValueError, match="lacks the demo model's weights"):
        trained_demo_model(path)
