"""Regenerate the paper excerpts the transcription tests read when the shared paper texts
(../shared/papers beside the repository) are not here, e.g. on a CI clone:

    .venv/bin/python tests/paper_excerpts/extract.py [PAPERS_DIR]

An excerpt keeps, in the paper's order and verbatim, every line of the paper text that holds a
transcribed value (config/papers/published/*.yaml) or that a row-order test looks for (ROW_MARKS),
so the tests check the same things against the excerpt as against the whole text.
tests/test_papers_transcription.py checks each excerpt against the paper whenever it is here.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SOURCES = {"fedcrc": "fedcrc", "grp_fed": "grp-fed", "fedcosr": "fedcosr", "calibre": "calibre", "fedgcr": "fedgcr"}
ROW_MARKS = {
    "fedcrc": ["FedRep [8]", "FedCRC-Per\t"],
    "grp_fed": ["GRP-FED 0.", "q-FFL 0.", "Method Global Test Local Test Personalization FedAvg"],
    "fedcosr": ["FedProto\t", "Averaged\t83.83", "mean accuracy of 90.08%"],
    "calibre": ["plus-or-minus"],
    "fedgcr": ["| FedGCR", "| T' = 6"],
}


def shown_values(paper: str) -> set[str]:
    """Each published value as the paper prints it (the OCR's reading where it differs)."""
    from fedrepro.report.papers import load_published

    out = set()
    for t in load_published(REPO / "config" / "papers" / "published" / f"{paper}.yaml").tables.values():
        for c in t.cells.values():
            for v in (c.value, c.pm):
                if v is not None:
                    out.add(c.ocr if c.ocr and v == c.value else repr(v))
    return out


def excerpt(paper: str, text: str) -> str:
    marks = shown_values(paper) | set(ROW_MARKS[paper])
    return "".join(line + "\n" for line in text.splitlines() if any(m in line for m in marks))


def main(papers: Path) -> None:
    for paper, src in SOURCES.items():
        out = HERE / f"{src}.txt"
        out.write_text(excerpt(paper, (papers / f"{src}.txt").read_text()))
        print(f"{out.relative_to(REPO)}: {len(out.read_text().splitlines())} lines")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO.parent / "shared" / "papers")
