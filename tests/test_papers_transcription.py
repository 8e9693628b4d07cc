"""The published numbers (config/papers/published/*.yaml) against the paper texts: every
value occurs in its paper's text, and a sample of rows reads in the paper's own order.

The texts are tests/paper_excerpts/*.txt, the papers' table lines kept verbatim, so the tests
run on any clone; where the full texts are here (../shared/papers beside the repository),
`test_excerpts_are_the_papers_own_lines` checks the excerpts against them."""

from __future__ import annotations

import functools
import re
import sys

import pytest

from conftest import REPO
from fedrepro.report.papers import DIMS, load_published

sys.path.insert(0, str(REPO / "tests" / "paper_excerpts"))
from extract import SOURCES, excerpt  # noqa: E402

PUBLISHED = REPO / "config" / "papers" / "published"
PAPERS = REPO.parent / "shared" / "papers"
EXCERPTS = REPO / "tests" / "paper_excerpts"
# Numeric cells per table, as transcribed (FedCoSR Table III: two "–" for FedPAC at β = 0.01).
CELLS = {
    "fedcrc": {"table1": 84, "table2": 18, "table3": 16},
    "grp_fed": {"table1": 64, "fig5": 36},  # fig5: 2 clients x 6 methods x (Global, Local, Personalization)
    "fedcosr": {"table2": 204, "table3": 204, "fairness": 2, "scarcity": 0},
    "calibre": {"table1": 12, "methods": 0},  # methods: Figs. 3-4, plots only in the paper
    "fedgcr": {"table1": 72, "table2": 72, "table3": 15, "table4": 24, "table5": 12},
}


def text(paper: str) -> str:
    return (EXCERPTS / f"{SOURCES[paper]}.txt").read_text()


@pytest.mark.parametrize("paper", sorted(SOURCES))
def test_excerpts_are_the_papers_own_lines(paper):
    """Each excerpt is exactly what tests/paper_excerpts/extract.py takes from the paper text."""
    path = PAPERS / f"{SOURCES[paper]}.txt"
    if not path.exists():
        pytest.skip(f"{path} is not here (the shared reference folder beside the repository)")
    assert text(paper) == excerpt(paper, path.read_text()), "rerun tests/paper_excerpts/extract.py"


@functools.cache
def published(paper: str):
    return load_published(PUBLISHED / f"{paper}.yaml")


def row(paper: str, table: str, method: str, **fixed) -> list:
    """The values of one row, in the layout's column order."""
    t = published(paper).tables[table]
    out = []
    for col in t.columns:
        key = {"method": method, **col.key}
        if all(key.get(d) == v for d, v in fixed.items()):
            c = t.cells.get(tuple(key[d] for d in DIMS))
            out.append(c)
    return out


def fmt(v: float, decimals: int) -> str:
    return f"{v:.{decimals}f}"


@pytest.mark.parametrize("paper", sorted(SOURCES))
def test_every_value_occurs_in_the_paper_text(paper):
    src = text(paper)
    p = load_published(PUBLISHED / f"{paper}.yaml")
    assert {tid: len(t.cells) for tid, t in p.tables.items()} == CELLS[paper]
    for t in p.tables.values():
        for key, c in t.cells.items():
            for v in (c.value, c.pm):
                if v is None:
                    continue
                shown = c.ocr if c.ocr and v == c.value else repr(v)
                assert shown in src, f"{paper} {t.id} {key}: {shown} not in the text"
            if c.value is None:
                assert c.note, f"{paper} {t.id} {key}: a '–' cell needs a note"


def test_fedcrc_rows_in_order():
    lines = text("fedcrc").splitlines()
    # Table I: the printed row is "FedRep [8]<TAB>98.47<TAB>..."; trailing zeros may be dropped (55.9)
    printed = next(line for line in lines if line.startswith("FedRep [8]")).split("\t")[1:]
    assert [float(x) for x in printed] == [c.value for c in row("fedcrc", "table1", "fedrep")]
    printed = next(line for line in lines if line.startswith("FedCRC-Per\t")).split("\t")[1:]
    assert [float(x) for x in printed] == [c.value for c in row("fedcrc", "table1", "fedcrc_per")]
    # Table II has no row labels in the text: its 6th printed row is FedCRC's (Table I's order)
    assert "60.43\t64.82\t64.62" in text("fedcrc")
    assert [c.value for c in row("fedcrc", "table2", "fedcrc")] == [60.43, 64.82, 64.62]
    assert [c.value for c in row("fedcrc", "table3", "fedcrc_tau0.5")] == [60.25, 69.79, 72.52, 75.77]


def test_grp_fed_rows_in_order():
    # The text prints "a±b" as "0.5690.004": value and std glued together
    line = next(x for x in text("grp_fed").splitlines() if x.startswith("GRP-FED 0."))
    cells = row("grp_fed", "table1", "grp_fed")
    assert line.split()[1:] == [fmt(c.value, 3) + fmt(c.pm, 3) for c in cells]
    line = next(x for x in text("grp_fed").splitlines() if x.startswith("q-FFL 0."))
    assert line.split()[1:] == [fmt(c.value, 3) + fmt(c.pm, 3) for c in row("grp_fed", "table1", "qffl")]


def test_fedcosr_rows_in_order():
    lines = text("fedcosr").splitlines()
    line = next(x for x in lines if x.startswith("FedProto\t"))
    nums = [float(n) for n in re.findall(r"\d+\.\d\d", line)]
    assert nums == [c.value for c in row("fedcosr", "table2", "fedproto")]
    line = next(x for x in lines if x.startswith("Averaged\t83.83"))
    assert [float(n) for n in re.findall(r"\d+\.\d\d", line)] == [c.value for c in row("fedcosr", "table2", "averaged")]
    # Table III, FedPAC: "–" at β = 0.01 and the OCR's "14.84" read as 74.84
    cells = row("fedcosr", "table3", "fedpac", setting="beta1")
    assert [c.value for c in cells] == [74.84, 3.44] and cells[0].ocr == "14.84"
    assert [c.value for c in row("fedcosr", "table3", "fedpac", setting="beta0.01")] == [None, None]
    assert [c.value for c in row("fedcosr", "fairness", "fedcosr")] == [90.08, 5.92]
    assert "mean accuracy of 90.08% with a standard deviation of 5.92%" in text("fedcosr")


def test_calibre_values_in_order():
    pairs = re.findall(r"(\d+\.\d+)±(\d+\.\d+)plus-or-minus", text("calibre"))
    t = load_published(PUBLISHED / "calibre.yaml").tables["table1"]
    # printed row by row (ablation), columns SimCLR, SwAV, SMoG
    mine = [(t.cells[(m, "cifar10", s, "acc")].value, t.cells[(m, "cifar10", s, "acc")].pm)
            for s in ("no_reg", "lp_only", "ln_only", "ln_lp") for m in ("calibre_simclr", "calibre_swav", "calibre_smog")]
    assert [(float(a), float(b)) for a, b in pairs] == mine


def test_fedgcr_rows_in_order():
    src = text("fedgcr")
    line = next(x for x in src.splitlines() if x.startswith("| FedGCR") and "85.82" in x)
    printed = [(float(a), float(b)) for a, b in re.findall(r"(\d+\.\d+)(?:</b>)?\s*\((\d+\.\d+)\)", line)]
    assert printed == [(c.value, c.pm) for c in row("fedgcr", "table1", "fedgcr")]
    assert [c.value for c in row("fedgcr", "table5", "fedgc")] == [79.49, 16.57, 11.61]
    assert "| T' = 6 | 85.86 | 8.45            | 8.16              | 82.99  | 11.92" in src
    assert [c.value for c in row("fedgcr", "table4", "fedgcr_t6")] == [85.86, 8.45, 8.16, 82.99, 11.92, 8.36]


def test_grp_fed_fig5_in_order():
    # Fig. 5's numbers are one run of text: "Method Global Test Local Test Personalization" then
    # "<method> <G> <L> <P>" per method, the upper client first, then again for the lower client
    line = next(x for x in text("grp_fed").splitlines() if x.startswith("Method Global Test Local Test Personalization FedAvg"))
    blocks = [b.strip() for b in line.split("Method Global Test Local Test Personalization") if b.strip()]
    assert len(blocks) == 2
    names = published("grp_fed").names["method"]
    t = published("grp_fed").tables["fig5"]
    methods = [r.key["method"] for r in t.rows]
    for setting, block in zip(("client_similar", "client_far"), blocks):
        expected = " ".join(f"{names[m]} " + " ".join(fmt(c.value, 3) for c in row("grp_fed", "fig5", m, setting=setting))
                            for m in methods)
        assert block == expected


RANK_MARKS = (("‡", r"ddagger|‡"), ("†", r"dagger|†"), ("*", r"\*"))  # \ddagger before \dagger


def _text_mark(cell: str) -> str | None:
    return next((mark for mark, pattern in RANK_MARKS if re.search(pattern, cell)), None)


def _marks(paper: str, table: str) -> dict:
    t = published(paper).tables[table]
    return {k: c.mark for k, c in t.cells.items() if c.mark}


def test_fedgcr_bold_cells_are_the_texts_bold_cells():
    """FedGCR's bold: exactly the <b>…</b> of the text (FedGCR's rows of Tables 1 and 2; 9.86, 8.40, 84.08, 9.04,
    81.88 and 9.07 are plain there although they are the best of their column)."""
    lines = [x for x in text("fedgcr").splitlines() if x.startswith("| FedGCR") and "<b>" in x]
    assert len(lines) == 2
    for table, line in zip(("table1", "table2"), lines):
        t = published("fedgcr").tables[table]
        printed = [c.strip() for c in line.strip().strip("|").split("|")][1:]
        fedgcr = next(r for r in t.rows if r.key["method"] == "fedgcr")
        expected = {t.key(fedgcr, col): "bold" for col, cell in zip(t.columns, printed) if "<b>" in cell}
        assert _marks("fedgcr", table) == expected and t.marks
    assert not any(_marks("fedgcr", tid) for tid in ("table3", "table4", "table5"))


def test_fedcosr_rank_marks_are_the_texts_marks():
    """The superscripts *, †, ‡ as the text prints them, row by row (Table II labelled, Table III in row order)."""
    lines = text("fedcosr").splitlines()
    t2 = published("fedcosr").tables["table2"]
    rows2 = [x.split("\t")[1:] for x in lines[lines.index(next(x for x in lines if x.startswith("Local\t"))):]
             if "\t" in x and not x.startswith("Averaged")][:16]
    end = lines.index(next(x for x in lines if x.startswith("78.12\t14.58")))
    rows3 = [x.split("\t") for x in lines[:end] if re.match(r"^\$?(\\underline\{|<u>)?\d", x) and x.count("\t") >= 11][-16:]
    for table, printed in (("table2", rows2), ("table3", rows3)):
        t = published("fedcosr").tables[table]
        rows = [r for r in t.rows if not r.derived]
        assert len(printed) == len(rows)
        expected = {}
        for r, cells in zip(rows, printed):
            cells = [c for c in cells if c.strip()]
            assert len(cells) == len(t.columns), cells
            expected |= {t.key(r, col): m for col, cell in zip(t.columns, cells) if (m := _text_mark(cell))}
        assert _marks("fedcosr", table) == expected and len(expected) == 3 * len(t.columns)
