"""A checkpoint's chat template is rendered within bounds: a template that would loop, compute or grow
text without useful end fails within seconds with a CheckpointError naming the template and the bound,
and a common one renders as before."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("jinja2")

from torchdelegate.errors import CheckpointError  # noqa: E402
from torchdelegate.llm.language_model import ChatTemplate  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
COMMON = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _rendered(template: str) -> tuple[str, float]:
    """What rendering ``template`` gives (its text, or the error's message) and how long it took."""
    started = time.monotonic()
    try:
        text = ChatTemplate("hostile.tdp", template, {"bos_token": "<s>"}).render(MESSAGES)
    except CheckpointError as e:
        text = str(e)
    return text, time.monotonic() - started


def test_a_common_template_renders_as_before() -> None:
    text, _ = _rendered(COMMON)
    assert text == "<s>user: hi\n<s>assistant: hello\nassistant:"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("template", "bound"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "1,000,000 steps"),
        ("{% for i in range(100000) %}{{ range(100000) | sum }}{% endfor %}", "took more than 2 s"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "made a text or list of more than 16,777,216 items",
        ),
        (
            "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "made a text or list of more than 16,777,216 items",
        ),
        ("{{ 'x' * 10**10 }}", "made a text or list of more than"),
        ("{{ 'a' | center(10**10) }}", "asked for 10,000,000,000 of something"),
        ("{{ '{:>9999999999}'.format(1) }}", "asked for a field wider than any text it may make"),
        ("{{ '%*s' % (9999999999, 'x') }}", "asked for 9,999,999,999 of something"),
        ("{{ 7 ** 9999999 }}", "asked for a number of more than 65,536 bits"),
        ("{{ ('a' * 4000) | replace('a', 'a' * 4000) | replace('a', 'aa') }}", "asked replace for a text of more"),
        ("{{ ('a' * 4000).replace('a', 'a' * 5000) }}", "asked replace for a text of more than"),
        ("{{ range(100000) | join('x' * 1000) }}", "asked join for a text of more than"),
        ("{{ ('x' * 1000).join(range(100000) | map('string')) }}", "asked join for a text of more than"),
        ("{{ ('\\n' * 100000) | indent(1000) }}", "asked indent for a text of more than"),
        ("{{ ('a ' * 100000) | wordwrap(1, wrapstring='y' * 1000) }}", "asked wordwrap for a text of more than"),
        ("{{ ('\\t' * 100000).expandtabs(10000) }}", "asked expandtabs for a text of more than"),
        ("{{ range(100000) | list | tojson(indent=100000) }}", "asked for a JSON indent of 100000 (more than 64)"),
        (
            "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
            "{% set ns.l = ns.l + [('x' * 16000000) ~ i] %}{% endfor %}",
            "made more than 67,108,864 characters and items in all",
        ),
    ],
    ids=[
        "nested-loops",
        "slow-steps",
        "doubled-text",
        "doubled-list",
        "repeat",
        "center",
        "format",
        "percent",
        "power",
        "replace",
        "replace-method",
        "join",
        "join-method",
        "indent",
        "wordwrap",
        "expandtabs",
        "tojson",
        "made-in-all",
    ],  # fmt: skip
)
def test_a_template_past_its_bounds_fails_fast_naming_the_template(template: str, bound: str) -> None:
    message, took = _rendered(template)
    assert message.startswith("hostile.tdp: its chat template "), message
    assert bound in message and "fix the template" in message, message
    assert took < 5, f"the template ran {took:.1f} s before it was stopped"


def test_llm_export_compiles_a_template_within_the_same_bounds() -> None:
    """jinja2 evaluates constant expressions while it compiles: unbounded, this took 1.4 GB at export."""
    import tracemalloc

    from torchdelegate.llm.checkpoint import read_chat_template

    tracemalloc.start()
    try:
        read_chat_template("{{ 'a'|center(3*10**8) }}", "chat_template.jinja")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20
