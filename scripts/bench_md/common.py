"""What every section of BENCHMARKS.md shares: the file, its section markers, and the helpers
that read benchmark JSON."""
import json
import re
from statistics import median
from pathlib import Path

PATH = Path(__file__).resolve().parent.parent.parent / "BENCHMARKS.md"
CORPUS = PATH.parent / "examples" / "gpt" / "data" / "corpus.txt"
TEMPLATES = Path(__file__).resolve().parent / "templates"
HEADER = "# Benchmarks\n\nMeasured figures; each section names the command that regenerates it.\n"


def write_section(name, body):
    text = PATH.read_text() if PATH.exists() else HEADER
    block = f"<!-- section: {name} -->\n{body}<!-- end: {name} -->\n"
    pattern = re.compile(
        rf"<!-- section: {re.escape(name)} -->\n.*?<!-- end: {re.escape(name)} -->\n", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    PATH.write_text(text)
    print(f"wrote the `{name}` section of {PATH}")


def render(template, **values):
    """The text of `templates/TEMPLATE.md` with its `{name}` and `{name:spec}` placeholders
    filled from `values` (Python's format syntax). The prose of every section lives in such a
    file; the section's code computes the figures and the table rows. A line that is only a
    placeholder whose value is empty (a table without rows) is left out."""
    lines = (TEMPLATES / f"{template}.md").read_text().split("\n")
    text = "\n".join(
        line for line in lines
        if not (line.startswith("{") and line.endswith("}") and values.get(line[1:-1]) == "")
    )
    try:
        return text.format_map(values)
    except KeyError as e:
        raise SystemExit(f"templates/{template}.md names {e}, which its section does not compute")


def last20(losses):
    tail = losses[-20:]
    return sum(tail) / len(tail)


def paired_rounds(runs, timed):
    """On/off tokens/s ratios round by round, and the largest loss difference of the pairs."""
    pairs = list(zip(runs["false"], runs["true"]))
    paired = [timed(on) / timed(off) for off, on in pairs]
    diff = max(abs(x - y) for off, on in pairs for x, y in zip(off["losses"], on["losses"]))
    return paired, diff


def steady_tokens(report, seq_len):
    """Tokens/s of a GPT run's median step after its first 5 (from its per-step seconds)."""
    return seq_len / median(report["step_seconds_per_sample"][5:])


def last_json(path):
    """The JSON summary a binary printed as its last line of stdout (None when absent)."""
    try:
        lines = [l for l in Path(path).read_text().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def test_counts(path):
    """Passed and failed counts from a test harness's output."""
    passed = failed = 0
    for m in re.finditer(r"test result: \w+\. (\d+) passed; (\d+) failed", Path(path).read_text()):
        passed += int(m.group(1))
        failed += int(m.group(2))
    return passed, failed


def max_rel(reference, other):
    """The largest relative difference of `other`'s losses from `reference`'s."""
    return max(abs(a - b) / abs(a) for a, b in zip(reference, other))


def compared(rows):
    """(key, reference, run, largest relative loss difference) for the rows where both ran."""
    for key, reference, run in rows:
        if reference and run:
            yield key, reference, run, max_rel(reference["losses"], run["losses"])

