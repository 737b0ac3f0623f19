"""scripts/tiny_model_report.py's code-prompt score: the first complete top-level statement of a
greedy continuation must parse and do something."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")  # the report script imports the training script's model
from tiny_model_report import first_statement  # noqa: E402  (scripts/ is on pytest's pythonpath)


@pytest.mark.parametrize("text", [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nprint(",
    "def add(a, b): return a + b",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.ite",
    "def f(x):\n    total = 0\n    for i in range(x):\n        if i:",   # cut inside a block
])
def test_a_statement_that_parses_and_does_something_counts(text):
    assert first_statement(text)[1], first_statement(text)[0]


@pytest.mark.parametrize("text", [
    "def fibonacci(n): 28166114344787221650689284666019998758277499526181487",
    "def add(a, b): 1, 1, 1, 1, 1, 1, 1, 1",
    "def f(n):\n    \"\"\"Only a docstring.\"\"\"\n\nx = 1",
    "def f(x):\n    \"\"\"Doc.\"\"\"\n    for i in range(x):\n        if i:",   # cut: only the docstring is whole
    "class Point: pass",
    "def main(): 0\n        self.assertEqual(self.defects, 0)",            # bad indentation
    "class Stack: Some the\n    # the file is a file",
])
def test_literals_pass_and_broken_code_do_not(text):
    assert not first_statement(text)[1], first_statement(text)[0]


def test_the_statement_ends_at_the_next_line_at_column_zero():
    stmt, ok = first_statement("def f():\n    return 1\n# comment\nx = (\n")
    assert ok and stmt == "def f():\n    return 1\n# comment"
