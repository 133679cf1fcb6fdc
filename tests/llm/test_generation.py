"""Generator: tokens from a loaded program's prefill and decode, equal to transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from language_models import static_cache_module, tiny_llama, transformers_greedy  # noqa: E402

import torchdelegate as td  # noqa: E402
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402
from torchdelegate.backends.reference import ReferencePartitioner  # noqa: E402
from torchdelegate.llm import Generator, Sampling  # noqa: E402

CACHE = 32
CHUNK = 8  # the prompt length prefill is exported for
VOCAB = 512


@pytest.fixture(scope="module")
def lowered(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = tiny_llama(vocab_size=VOCAB)
    module = static_cache_module(model, CACHE)
    calls = {
        "prefill": {"input_ids": torch.zeros(1, CHUNK, dtype=torch.long), "cache_position": torch.arange(CHUNK)},
        "decode": {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.tensor([CHUNK])},
    }
    with torch.no_grad():
        programs = {m: torch.export.export(module, (), x, strict=True) for m, x in calls.items()}
    path = tmp_path_factory.mktemp("llm") / "llama.tdp"
    td.to_edge_transform_and_lower(programs, partitioner=[OnnxRuntimePartitioner(), ReferencePartitioner()]).save(path)
    return model, path


@pytest.mark.parametrize("length", [3, CHUNK, 13, 20])
def test_greedy_tokens_equal_transformers_generate_for_any_prompt_length(
    lowered: tuple[torch.nn.Module, Path], length: int
) -> None:
    """Shorter prompts are padded, longer ones read in chunks, the last one padded or, past the
    cache's room, token by token."""
    model, path = lowered
    prompt = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with td.load(path) as program:
        generation = Generator(program, max_positions=CACHE).generate(prompt, 10)
    assert generation.tokens == transformers_greedy(model, prompt, 10)
    assert generation.finish == "max new tokens" and generation.stats.new_tokens == 10


@pytest.fixture(scope="module")
def last_logits(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """The model exported as ``llm export`` does with ``--prefill-chunk``: prefill gives the logits of
    its chunk's last position only."""
    from torchdelegate.llm.checkpoint import export_methods, logits_given

    model = tiny_llama(vocab_size=VOCAB)
    path = tmp_path_factory.mktemp("llm") / "last.tdp"
    programs = export_methods(model, CACHE, CHUNK)
    assert logits_given(programs["prefill"]) == "last"
    assert not model._forward_pre_hooks and "forward" not in vars(model)  # the model as it was
    td.to_edge_transform_and_lower(programs, partitioner=[OnnxRuntimePartitioner(), ReferencePartitioner()]).save(path)
    return model, path


@pytest.mark.parametrize(("length", "cached"), [(3, 0), (CHUNK, 0), (13, 0), (13, 3), (30, 5)])
def test_a_prefill_giving_the_last_position_s_logits_reads_a_padded_chunk_s_last_token_again(
    last_logits: tuple[torch.nn.Module, Path], length: int, cached: int
) -> None:
    """The padded chunk's one row of logits is the padding's; the tokens are still transformers',
    after ``cached`` tokens an earlier call left (a conversation's turns) and where the last chunk
    has no room in the cache (30 from 5: read token by token from 29)."""
    model, path = last_logits
    prompt = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    new = min(6, CACHE - length)
    with td.load(path) as program:
        ids = torch.tensor([prompt[:CHUNK] + [1] * (CHUNK - min(length, CHUNK))])
        assert program.run("prefill", input_ids=ids, cache_position=torch.arange(CHUNK)).shape == (1, 1, VOCAB)
        generator = Generator(program, max_positions=CACHE)
        if cached:
            generator.generate(prompt[:cached], 1)
        assert generator.generate(prompt, new, cached=cached).tokens == transformers_greedy(model, prompt, new)


def test_stop_tokens_end_generation_and_streaming_gives_the_same_tokens(lowered: tuple[torch.nn.Module, Path]) -> None:
    model, path = lowered
    prompt = [5, 6, 7, 8]
    expected = transformers_greedy(model, prompt, 8)
    with td.load(path) as program:
        generator = Generator(program, stop_tokens=[expected[3]], max_positions=CACHE)
        seen: list[int] = []
        generation = generator.generate(prompt, 8, on_token=seen.append)
        streamed = list(generator.stream(prompt, 8))
    assert generation.tokens == seen == streamed == expected[: expected.index(expected[3]) + 1]
    assert generation.finish == "stop token"


def test_sampling_is_reproducible_with_a_seed_and_the_cache_bounds_generation(
    lowered: tuple[torch.nn.Module, Path],
) -> None:
    _, path = lowered
    sampling = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=7)
    with td.load(path) as program:
        generator = Generator(program, max_positions=CACHE)
        first = generator.generate([1, 2, 3], 6, sampling).tokens
        assert generator.generate([1, 2, 3], 6, sampling).tokens == first
        full = generator.generate(list(range(3, 27)), 50)
        assert full.finish == "cache full" and len(full.tokens) == CACHE - 24 + 1
        with pytest.raises(ValueError, match="the prompt has 40 tokens and the cache holds 32 positions"):
            generator.generate(list(range(40)), 4)
    for bad, message in (({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p")):
        with pytest.raises(ValueError, match=message):
            Sampling(**bad)  # type: ignore[arg-type]


def test_sampling_within_one_token_gives_the_greedy_tokens_and_seeds_draw_differently(
    lowered: tuple[torch.nn.Module, Path],
) -> None:
    """top_k=1, or a top_p the most likely token alone reaches, leaves only the greedy token to draw;
    a high temperature over every token draws differently under different seeds."""
    model, path = lowered
    prompt = [5, 6, 7, 8]
    expected = transformers_greedy(model, prompt, 6)
    with td.load(path) as program:
        generator = Generator(program, max_positions=CACHE)
        for narrow in (Sampling(temperature=1.5, top_k=1, seed=1), Sampling(temperature=1.5, top_p=1e-9, seed=2)):
            assert generator.generate(prompt, 6, narrow).tokens == expected
        drawn = {tuple(generator.generate(prompt, 6, Sampling(temperature=5.0, seed=seed)).tokens) for seed in range(4)}
    assert len(drawn) > 1


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """The same model with a prefill of any prompt length, exported as ``llm export`` does."""
    from torchdelegate.llm.checkpoint import export_methods

    model = tiny_llama(vocab_size=VOCAB)
    path = tmp_path_factory.mktemp("llm") / "dynamic.tdp"
    programs = export_methods(model, CACHE, None)
    td.to_edge_transform_and_lower(programs, partitioner=[OnnxRuntimePartitioner(), ReferencePartitioner()]).save(path)
    return model, path


def test_a_prefill_of_dynamic_length_reads_any_prompt_in_one_call(dynamic: tuple[torch.nn.Module, Path]) -> None:
    """One token (read by decode), a few, the most the cache takes; and a prompt read after ``cached``
    tokens an earlier call left in the cache."""
    model, path = dynamic
    with td.load(path) as program:
        generator = Generator(program, max_positions=CACHE)
        assert generator.chunk is None
        logits = program.run("prefill", input_ids=torch.tensor([[4, 5, 6]]), cache_position=torch.arange(3))
        assert logits.shape == (1, 1, VOCAB)  # the head ran for the last position only
        for length in (1, 5, CACHE - 1):
            prompt = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            assert generator.generate(prompt, 1).tokens == transformers_greedy(model, prompt, 1)
        first = generator.generate([4, 5, 6, 7], 3).tokens
        prompt = [4, 5, 6, 7, *first[:-1], 9, 10]
        assert generator.generate(prompt, 4, cached=6).tokens == transformers_greedy(model, prompt, 4)
        with pytest.raises(ValueError, match="cached 6: give 0 to 5"):
            generator.generate(prompt[:6], 1, cached=6)


def test_each_layer_s_cache_is_written_where_the_program_holds_it(dynamic: tuple[torch.nn.Module, Path]) -> None:
    """Both methods scatter each layer's new keys and values into the cache the program holds
    (IO binding), rather than returning a new cache to be copied back: no cache-sized copy per token.
    Each layer's length counter, which the model never reads, is written where the program holds it too."""
    model, path = dynamic
    layers = model.config.num_hidden_layers
    with td.load(path) as program:
        program.initialize()
        assert [len(d._handle.written) for d in program._delegates] == [3 * layers, 3 * layers]
        prompt = [4, 5, 6, 7, 8]
        generated = Generator(program, max_positions=CACHE).generate(prompt, 6).tokens
        assert generated == transformers_greedy(model, prompt, 6)


@pytest.mark.parametrize("fixture", ["dynamic", "last_logits"])
def test_a_warmed_up_generator_gives_the_tokens_of_a_cold_one(fixture: str, request: pytest.FixtureRequest) -> None:
    """The warm-up's writes into the cache are the first prompt's to overwrite: a prompt shorter than
    prefill's chunk, and one token alone, generate transformers' tokens after it."""
    model, path = request.getfixturevalue(fixture)
    for prompt in ([11, 12, 13], [7]):
        with td.load(path) as program:
            generator = Generator(program, max_positions=CACHE)
            generator.warm_up()
            assert generator.generate(prompt, 6).tokens == transformers_greedy(model, prompt, 6)
