"""``torchdelegate cache info|clear [--kind compile|machine]``: the one cache, shown or emptied."""

from __future__ import annotations

import argparse
from typing import TextIO

from torchdelegate.cli.command import EXIT_OK, CommandError

HELP = "show or empty the cache (compiled partitions and prepared programs)"
DESCRIPTION = (
    "The one cache both kinds of entries live in: compiled partitions (lower, llm export) and "
    "what prepare keeps for this machine. It is TORCHDELEGATE_CACHE (a directory or an fsspec URL; 'off': "
    "none), by default ~/.cache/torchdelegate, bounded by TORCHDELEGATE_CACHE_MAX_BYTES (16 GiB), least "
    "recently used first."
)


def define(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["info", "clear"], help="info: where it is and what it holds; clear: empty it"
    )
    parser.add_argument("--kind", choices=["compile", "machine"], help="only this kind of entry")
    parser.set_defaults(handler=cache_command)


def cache_command(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.cache.compile_cache import BINDINGS, ENTRIES
    from torchdelegate.cache.store import Store, StoreError
    from torchdelegate.cache.store_settings import CACHE_VARIABLE, cache_location, max_bytes_setting
    from torchdelegate.report.terminal import human_bytes

    location = cache_location()
    if location is None:
        print(f"the cache is off ({CACHE_VARIABLE}=off): nothing is kept", file=out)
        return EXIT_OK
    try:
        store, bound = Store(location), max_bytes_setting()
    except (StoreError, ValueError) as e:
        raise CommandError(str(e)) from e
    compile_kinds = {ENTRIES, BINDINGS}
    kinds = [k for k in store.kinds() if args.kind is None or (k in compile_kinds) == (args.kind == "compile")]
    if args.action == "clear":
        freed = sum(store.clear(kind) for kind in kinds)
        what = f"{args.kind} entries" if args.kind else "every entry"
        print(f"{location}: removed {what}, {human_bytes(freed)}", file=out)
        return EXIT_OK
    entries = [e for kind in kinds for e in store.entries(kind)]
    for entry in entries:
        if entry.damage is not None:
            store.warn_damaged(entry, "it is not used; `torchdelegate cache clear` removes it")
    print(f"{location}: {human_bytes(sum(e.size for e in entries))} of at most {human_bytes(bound)}", file=out)
    for kind in kinds:
        listed = [e for e in entries if e.kind == kind]
        label = "compiled partitions" if kind == ENTRIES else "bindings" if kind == BINDINGS else "prepared (machine)"
        damaged = sum(e.damage is not None for e in listed)
        left = sum(not e.whole for e in listed) - damaged
        extra = (f", {left} left unfinished" if left else "") + (f", {damaged} damaged" if damaged else "")
        size = human_bytes(sum(e.size for e in listed))
        print(f"  {kind}: {len(listed)} entries, {size} ({label}{extra})", file=out)
    return EXIT_OK
