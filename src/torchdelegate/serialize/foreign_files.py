"""Files of other formats that people hand to a command expecting ours, told apart by their zip
members without unpickling or importing anything: ``torch.export.save`` archives (which ``lower``
reads) and ``torch.save`` files (a pickled module, state dict or tensors, which nothing here reads)."""

from __future__ import annotations

import os
import zipfile

EXPORTED_PROGRAM = "torch.export.save"
PICKLED = "torch.save"

TORCH_SAVE_ADVICE = (
    "it is a torch.save file (a pickled module, state dict or tensors), which holds no program to lower; "
    "build the model in Python, export it with torch.export.export and save that with torch.export.save, "
    "then `torchdelegate lower METHOD=FILE.pt2 ...` (or call torchdelegate.to_edge_transform_and_lower on the export)"
)


def zip_kind(path: str | os.PathLike[str]) -> str | None:
    """``EXPORTED_PROGRAM``, ``PICKLED``, or None for a file that is neither (or not a zip we can read).

    Both formats are zips of one top folder; torch.export.save's holds ``archive_format`` or a
    ``models/`` folder of program documents, torch.save's a ``data.pkl`` beside no such thing.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    tails = {member.split("/", 1)[-1] for member in members}
    if "archive_format" in tails or any(tail.startswith("models/") for tail in tails):
        return EXPORTED_PROGRAM
    if "data.pkl" in tails:
        return PICKLED
    return None
