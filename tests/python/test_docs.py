"""The Python examples in docs/api.md run as written (in order, in one namespace)."""
import pathlib
import re

from launcher import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_api_doc_example_runs():
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/api.md has no python example"
    assert launch("workers_ddp", "run_python_block", 1, "\n".join(blocks)) == [True]


def test_cpp_doc_example_is_the_quickstart_ci_runs():
    text = (ROOT / "docs" / "api.md").read_text()
    quickstart = (ROOT / "examples" / "cpp" / "quickstart.cpp").read_text()
    blocks = re.findall(r"```cpp\n(.*?)```", text, re.S)
    assert quickstart in blocks, "docs/api.md's C++ example differs from examples/cpp/quickstart.cpp"


def test_fsdp_doc_example_runs_on_two_ranks():
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "gradcomp.torch.fsdp(" in b]
    assert len(blocks) == 1, "docs/api.md should have one FSDP2 example"
    assert launch("workers_ddp", "run_python_block", 2, blocks[0]) == [True, True]


def test_diloco_doc_example_runs_on_two_ranks():
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "gradcomp.torch.diloco(" in b]
    assert len(blocks) == 1, "docs/api.md should have one DiLoCo example"
    assert launch("workers_ddp", "run_python_block", 2, blocks[0]) == [True, True]
