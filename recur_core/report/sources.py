"""Where training data comes from, by source rather than by a path on the machine that trained.

The trainer records every local data file it read (name, bytes, sha256) in meta.json's
"data_files"; the checkpoint card (recur_core/report/export.py) names each one by its source through KNOWN:
dataset, split, which part of which file, license, and how to get it. Checkpoints trained before
"data_files" existed only recorded the path patterns given to --data / --val-data ("data"); their
file names are then matched against the patterns.
"""
from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass
from pathlib import Path

VAL_PER_MILLE = 5  # training documents held out for validation when no validation split is given (training/data.py)
HASH_LIMIT_BYTES = 256 * 2 ** 20  # larger files are recorded by name and size only
TINYSTORIES = "TinyStories (Eldan & Li, 2023), Hugging Face dataset `roneneldan/TinyStories`"
TINYSTORIES_LICENSE = "CDLA-Sharing-1.0"
FINEWEB_EDU = "FineWeb-Edu, Hugging Face dataset `HuggingFaceFW/fineweb-edu`"
FINEWEB_EDU_LICENSE = "ODC-By 1.0 (and the CommonCrawl Terms of Use)"


@dataclass(frozen=True)
class Source:
    name: str  # the file name it was trained from
    folder: str  # the folder it sat in (for matching old "data" patterns)
    dataset: str
    split: str
    part: str  # which part of which released file
    license: str
    how_to_get: str
    sha256: str  # first 16 hex digits

    def markdown(self) -> str:
        return (f"`{self.name}` (sha256 {self.sha256}…): {self.dataset}, split `{self.split}`; {self.part}. "
                f"License {self.license}. To get it: {self.how_to_get}.")


HUB_FILE = "download `{file}` from the dataset's Files page on Hugging Face (`huggingface-cli download " \
           "roneneldan/TinyStories {file} --repo-type dataset`)"
KNOWN = (
    Source("TinyStories-train.head.txt", "tinystories", TINYSTORIES, "train",
           "the first 2 MiB of the V1 file `TinyStories-train.txt` (2,316 stories, 2,096,346 bytes; stories end "
           "with `<|endoftext|>` lines; the story cut off at 2 MiB removed)", TINYSTORIES_LICENSE,
           HUB_FILE.format(file="TinyStories-train.txt") + ", keep its first 2,097,152 bytes and drop the "
           "incomplete last story", "ba02237f5747a07d"),
    Source("TinyStoriesV2-GPT4-train.head.txt", "tinystories", TINYSTORIES, "train",
           "the first 10,000 lines of the V2 (GPT-4 only) file `TinyStoriesV2-GPT4-train.txt` (1,727 stories, "
           "1,424,242 bytes; the cut-off last story removed)", TINYSTORIES_LICENSE,
           HUB_FILE.format(file="TinyStoriesV2-GPT4-train.txt") + ", keep its first 10,000 lines and drop the "
           "incomplete last story", "e4b2c089502cf780"),
    Source("TinyStories-valid.head.hf-export.txt", "tinystories", TINYSTORIES, "validation",
           "the start of the V1 validation split as exported from the hub's `validation` split (about 1,000 "
           "stories, 794,375 bytes; a blank line after each story and between paragraphs)", TINYSTORIES_LICENSE,
           "`datasets.load_dataset(\"roneneldan/TinyStories\", split=\"validation\")`, writing each story's text "
           "followed by a blank line, the first 794,375 bytes", "5fc1fb0113df62b5"),
    Source("fineweb-edu_sample-10BT_150docs.jsonl", "fineweb-edu", FINEWEB_EDU + ", config `sample-10BT`", "train",
           "the first 150 distinct documents in stream order whose text is 500–10,000 characters long (field "
           "`text`)", FINEWEB_EDU_LICENSE,
           "`datasets.load_dataset(\"HuggingFaceFW/fineweb-edu\", \"sample-10BT\", split=\"train\", streaming=True)`, "
           "keeping the first 150 such documents", "a8130ba3d67c92ec"),
)
KNOWN_HUB = {"roneneldan/TinyStories": (TINYSTORIES, TINYSTORIES_LICENSE),
             "HuggingFaceFW/fineweb-edu": (FINEWEB_EDU, FINEWEB_EDU_LICENSE)}


def file_record(path: Path, role: str) -> dict:
    """What meta.json's "data_files" keeps of one file the trainer read."""
    size = path.stat().st_size
    digest = None
    if size <= HASH_LIMIT_BYTES:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"name": path.name, "role": role, "bytes": size, "sha256": digest}


def identify(meta: dict) -> dict[str, list]:
    """{"train": [...], "validation": [...]}: each a Source, or a plain description where no known
    source matches; a hub dataset is described by its id."""
    out = {"train": [], "validation": []}
    records = meta.get("data_files")
    if records:
        for rec in records:
            by_hash = next((s for s in KNOWN if rec.get("sha256") and s.sha256 == rec["sha256"]), None)
            out[rec["role"]].append(by_hash or f"`{rec['name']}` ({rec['bytes']:,} bytes, sha256 "
                                                f"{rec.get('sha256') or 'not computed'}): source not recorded")
        return out
    train, _, val = str(meta.get("data", "")).partition(" (validation: ")
    for role, spec in (("train", train.strip()), ("validation", val.rstrip(")").strip())):
        if spec == "hashed hold-out":
            out[role].append(f"a hashed {VAL_PER_MILLE / 10:g}% hold-out of the training documents (training/data.py)")
            continue
        if not spec:
            continue
        if "/" in spec and not Path(spec).suffix and "*" not in spec and not spec.startswith((".", "/")):
            dataset, licence = KNOWN_HUB.get(spec, (f"Hugging Face dataset `{spec}`", "see its dataset card"))
            out[role].append(f"{dataset}, split `{role}` (streamed). License {licence}.")
            continue
        pattern = "/".join(Path(spec).parts[-2:])
        matches = [s for s in KNOWN if fnmatch.fnmatch(f"{s.folder}/{s.name}", pattern)]
        out[role] += matches or [f"local files `{Path(spec).name}`: source not recorded"]
    return out

