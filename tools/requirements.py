"""Print the requirements of pyproject.toml, one per line, for pip.

    python tools/requirements.py build        # [build-system] requires
    python tools/requirements.py test bench   # [project.optional-dependencies] extras

The Makefile installs from these lists, so pyproject.toml is the only one.
"""

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def load():
    text = PYPROJECT.read_text()
    if tomllib is not None:
        return tomllib.loads(text)
    import ast
    import re
    # enough TOML for this file: the two tables of string lists read here
    data = {"build-system": {}, "project": {"optional-dependencies": {}}}
    section = None
    for match in re.finditer(r"^\[([^\]]+)\]|^(\w[\w-]*)\s*=\s*(\[[^\]]*\])", text, re.M):
        if match.group(1):
            section = match.group(1)
        elif section == "build-system" and match.group(2) == "requires":
            data["build-system"]["requires"] = ast.literal_eval(match.group(3))
        elif section == "project.optional-dependencies":
            data["project"]["optional-dependencies"][match.group(2)] = ast.literal_eval(
                match.group(3))
    return data


def main(names):
    data = load()
    for name in names:
        if name == "build":
            requirements = data["build-system"]["requires"]
        else:
            requirements = data["project"]["optional-dependencies"][name]
        print("\n".join(requirements))


if __name__ == "__main__":
    main(sys.argv[1:])
