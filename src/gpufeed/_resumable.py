"""Whether a loader's state can really be taken: probed, not guessed from its methods' names."""

from __future__ import annotations

from typing import Any


def why_not_resumable(loader: Any) -> str | None:
    """None when ``loader`` can give its state (``state_dict()`` answers) and take it back
    (``load_state_dict``); otherwise why not, in a sentence that says what to do."""
    name = type(loader).__name__
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        return (f"a {name} has no state_dict(). Wrap a torchdata StatefulDataLoader "
                "(pip install 'gpufeed[resume]') or a SourceLoader")
    return None


def take_state(loader: Any) -> tuple[Any, str | None]:
    """``loader.state_dict()``, or None and why it cannot be taken (a wrapper whose ``state_dict`` works only
    in a mode it is not in). Asked right after a batch: asked before its iteration, a loader with workers
    could start them."""
    try:
        return loader.state_dict(), None
    except Exception as exc:
        return None, f"{type(loader).__name__}.state_dict() raised {type(exc).__name__}: {exc}"
