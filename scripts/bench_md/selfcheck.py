"""Renders every section of BENCHMARKS.md from symbolic benchmark output, without running a
benchmark: each value read from a JSON file is a `Symbol` that takes part in arithmetic,
comparisons and formatting and prints as the expression it stands for. A section whose code
and templates disagree (a placeholder its code does not compute, a template no section
renders) fails here, in a second, rather than at the end of an hour-long benchmark.

    python3 scripts/bench_md/selfcheck.py
"""
import builtins
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_md import common  # noqa: E402

FAKE = "BENCH_OUT"


class Symbol:
    """A value read from benchmark output, standing for the expression `path`."""

    def __init__(self, path):
        object.__setattr__(self, "path", path)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [Symbol(f"{self.path}[{key.start}:{key.stop}]#{i}") for i in range(2)]
        return Symbol(f"{self.path}[{key!r}]")

    def get(self, key, default=None):
        return Symbol(f"{self.path}.get({key!r})")

    def items(self):
        return [(f"k{i}", Symbol(f"{self.path}.k{i}")) for i in range(2)]

    def __iter__(self):
        return iter([Symbol(f"{self.path}#{i}") for i in range(3)])

    def __len__(self):
        return 3

    def __contains__(self, _):
        return True

    def _op(op, swap=False):
        def apply(a, b):
            x, y = (b, a) if swap else (a, b)
            return Symbol(f"({getattr(x, 'path', x)!s}{op}{getattr(y, 'path', y)!s})")
        return apply

    __add__, __sub__, __mul__, __truediv__ = _op("+"), _op("-"), _op("*"), _op("/")
    __floordiv__, __mod__, __pow__ = _op("//"), _op("%"), _op("**")
    __radd__, __rsub__, __rmul__ = _op("+", True), _op("-", True), _op("*", True)
    __rtruediv__, __rfloordiv__ = _op("/", True), _op("//", True)

    def __neg__(self):
        return Symbol(f"-{self.path}")

    def __abs__(self):
        return Symbol(f"abs({self.path})")

    def __lt__(self, other):
        return str(self) < str(other)

    __le__ = __gt__ = __ge__ = __lt__

    def _field(self):
        # The same field of two files (a stage in the runs before and after) is one key.
        return self.path.split(".json", 1)[-1]

    def __eq__(self, other):
        return isinstance(other, Symbol) and other._field() == self._field()

    def __hash__(self):
        return hash(self._field())

    def __int__(self):
        return 1

    def __float__(self):
        return 1.0

    def __index__(self):
        return 2

    def __format__(self, spec):
        return f"<{self.path}|{spec}>"

    def __str__(self):
        return f"<{self.path}>"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: Symbol(f"{self.path}.{name}()")


class FakeFile:
    def __init__(self, name):
        self.name = str(name)

    def read(self):
        return f"output of {self.name}\n"


def fake(path):
    return str(path).startswith(FAKE)


def install(exists):
    """Benchmark output is read from `FAKE/...`: every file there exists (or none does)."""
    real_open, real_exists, real_read = builtins.open, Path.exists, Path.read_text
    real_glob, real_stat = Path.glob, Path.stat
    builtins.open = lambda p, *a, **k: FakeFile(p) if fake(p) else real_open(p, *a, **k)
    json.load = lambda f: Symbol(f"json:{f.name}")
    json.loads = lambda text: Symbol(f"json:{text}")
    Path.exists = lambda self: exists if fake(self) else real_exists(self)
    Path.read_text = lambda self, *a, **k: (
        '{"output": "%s"}\ntest result: ok. 3 passed; 0 failed\n' % self if fake(self)
        else real_read(self, *a, **k)
    )
    Path.glob = lambda self, pattern: (
        iter([self / pattern.replace("*", f"x{i}") for i in range(2)]) if fake(self)
        else real_glob(self, pattern)
    )
    Path.stat = lambda self, *a, **k: (
        os.stat_result((0, 0, 0, 0, 0, 0, 1, 0, 0, 0)) if fake(self) else real_stat(self, *a, **k)
    )


SECTIONS = {
    "pipeline": ("pipeline", [f"{FAKE}/b.json", f"{FAKE}/m.json", f"{FAKE}/t.json", "2"]),
    "onebit": ("onebit", [FAKE, "16", "2"]),
    "zero": ("zero", [FAKE, "2"]),
    "learner": ("learner", [FAKE, "2"]),
    "kernels": ("kernels", [f"{FAKE}/k.json", "2"]),
    "precision": ("precision", [FAKE, "2"]),
    "offload": ("offload", [FAKE, "2"]),
    "resume": ("resume", [FAKE, "2"]),
    "recorder": ("recorder", [FAKE, "2"]),
    "slow_links": ("slow_links", [FAKE, "2"]),
    "long_context": ("long_context", [FAKE, "2"]),
    "moonshot": ("moonshot", [FAKE, "2", "1"]),
    "device_flex": ("device_flex", [FAKE, "2", "rev", "2"]),
    "redesign_flex": ("device_flex", [FAKE, "2", "rev", "2", "redesign-flex"]),
    "grid3d": ("grid3d", [f"{FAKE}/b.json", f"{FAKE}/m.json", "2"]),
    "inference": ("inference", [FAKE, "32", "2"]),
    "quantization": ("quantization", [FAKE, "10", "20", "2"]),
    "moe": ("moe", [FAKE, "10", "2"]),
    "overhead": ("overhead", [FAKE, "2"]),
    "vs_pytorch": ("vs_pytorch", [FAKE, "2"]),
    "overlap": ("overlap", [FAKE, "2"]),
    "overlap3": ("overlap", [FAKE, "2"]),
    "gpu": ("gpu", [FAKE]),
}


def main():
    import importlib

    used = set()
    render = common.render

    def recording(template, **values):
        used.add(template)
        return render(template, **values)

    common.render = recording
    modules = {m: importlib.import_module(f"bench_md.{m}") for m, _ in SECTIONS.values()}
    for m in modules.values():
        m.render = recording
    passed = failed = 0
    for exists in (True, False):
        install(exists)
        for name, (module, args) in SECTIONS.items():
            function = name if hasattr(modules[module], name) else module
            try:
                text = getattr(modules[module], function)(*args)
                assert text.startswith("## "), f"{name} does not start with a heading"
                passed += 1
            except BaseException as e:  # SystemExit included: a template names a missing value
                failed += 1
                print(f"{name} (files {'present' if exists else 'absent'}): {e!r}")
    unused = {p.stem for p in common.TEMPLATES.glob("*.md")} - used
    for t in sorted(unused):
        failed += 1
        print(f"templates/{t}.md is rendered by no section")
    print(f"bench_md templates: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
