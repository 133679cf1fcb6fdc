"""Request bodies read as ``llm serve`` reads them, without a server: what is honoured, what is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from torchdelegate.llm.serving.openai_requests import RequestError, generation_request  # noqa: E402

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_max_tokens_and_max_completion_tokens_that_disagree_are_refused() -> None:
    assert generation_request({**CHAT, "max_completion_tokens": 5}, True, "tiny").max_tokens == 5
    assert generation_request({**CHAT, "max_tokens": 5, "max_completion_tokens": 5}, True, "tiny").max_tokens == 5
    with pytest.raises(RequestError, match="max_tokens 2 and max_completion_tokens 3 disagree: give one of them") as e:
        generation_request({**CHAT, "max_tokens": 2, "max_completion_tokens": 3}, True, "tiny")
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", "5", "max_tokens is a string: give an integer"),
        ("max_tokens", True, "max_tokens is true or false: give an integer"),
        ("stream", 1, "stream is an integer: give true or false"),
        ("model", None, "model is missing: give a string"),
    ],
)
def test_a_field_of_the_wrong_type_names_the_json_type_wanted(field: str, value: object, message: str) -> None:
    with pytest.raises(RequestError, match=message) as e:
        generation_request({**CHAT, field: value}, True, "tiny")
    assert e.value.param == field
