"""The app declares every handler's parameters in Litestar's explicit styles (FromPath, FromQuery, JSONBody,
NamedDependency, ...): building it raises no LitestarDeprecationWarning, so that Litestar 3 finds nothing inferred."""

from __future__ import annotations

import warnings
from pathlib import Path

from litestar.exceptions import LitestarDeprecationWarning

from server.app import create_app
from server.settings import Settings, sqlite_url


def test_create_app_raises_no_litestar_deprecation_warning(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, database_url=sqlite_url(tmp_path / "coordinator.sqlite3"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        create_app(settings)
    found = [str(w.message) for w in caught if issubclass(w.category, LitestarDeprecationWarning)]
    assert found == [], "\n".join(found)
