"""The coordinator's folders say what they hold: outside the api/ and web/ pair of one resource, no two of its
modules share a name, so a module's name alone says which one it is."""

from __future__ import annotations

from collections import defaultdict

from tests.support import ROOT

PAIRED = ("api", "web")  # a resource's REST controller and its UI routes share its name


def test_every_module_of_the_coordinator_has_a_name_of_its_own() -> None:
    places: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "server").rglob("*.py")):
        if not path.name.startswith("__"):
            places[path.stem].append(path.parent.relative_to(ROOT).as_posix())
    for folder in sorted((ROOT / "server").rglob("*")):
        if folder.is_dir() and folder.name != "__pycache__" and (folder / "__init__.py").exists():
            places[folder.name].append(f"{folder.parent.relative_to(ROOT).as_posix()} (a package)")
    shared = {
        name: where
        for name, where in places.items()
        if len(where) > 1 and sorted(where) != sorted(f"server/{pair}" for pair in PAIRED)
    }
    assert len(places) > 40  # every module was seen
    assert shared == {}
