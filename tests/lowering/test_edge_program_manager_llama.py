"""A transformers Llama as prefill + decode: to_edge, whole-graph lowering, eager's logits."""

import pytest
import torch

from torchdelegate import DelegationSpec, to_edge

transformers = pytest.importorskip("transformers")
import backends_for_tests  # noqa: E402, F401  (registers the TestTorchExport backend this test lowers to)
from language_models import tiny_llama  # noqa: E402
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM  # noqa: E402


def test_llama_prefill_and_decode_lowered_whole_give_eagers_logits() -> None:
    model = tiny_llama(hidden_size=32, vocab_size=100)
    prompt = torch.randint(0, 100, (1, 8))
    exporter = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16)
    with torch.no_grad():
        programs = {
            "prefill": exporter.export(input_ids=prompt, cache_position=torch.arange(8)),
            "decode": exporter.export(input_ids=torch.tensor([[7]]), cache_position=torch.tensor([8])),
        }
    edge = to_edge(programs)
    assert edge.exported_program("decode").graph_signature.buffers_to_mutate  # the static cache, functional
    lowered = edge.to_backend(DelegationSpec("TestTorchExport"))
    assert {m: len(d) for m, d in lowered.delegates().items()} == {"prefill": 1, "decode": 1}
    prefill, decode = (lowered.exported_program(m).module() for m in ("prefill", "decode"))
    # The static-cache module that export traced (the outer wrapper's forward drops cache_position).
    eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16).model
    with torch.no_grad():
        expected = eager(input_ids=prompt, cache_position=torch.arange(8))
        torch.testing.assert_close(prefill(input_ids=prompt, cache_position=torch.arange(8)), expected)
        for step, token in enumerate((7, 3, 42)):  # decode reads the cache prefill wrote
            ids, position = torch.tensor([[token]]), torch.tensor([8 + step])
            expected = eager(input_ids=ids, cache_position=position)
            torch.testing.assert_close(decode(input_ids=ids, cache_position=position), expected)
