"""Whether a loader's position can really be saved and restored (``state_dict``/``load_state_dict``).

Standalone: imports nothing from gpufeed's core (nor accelerate or torchdata), so any prefetcher design can
ask it. Having the two methods is not enough: accelerate's ``DataLoaderShard``, ``DataLoaderDispatcher``
and ``SkipDataLoader`` always have them, but ``state_dict()`` raises ``AttributeError`` unless accelerate
built them with ``use_stateful_dataloader=True``.

What is probed, and what is not:

* accelerate's loaders: whether they were built stateful (an attribute of the instance), then
  ``state_dict()``, which only returns the state accelerate keeps (it starts nothing).
* torchdata's ``StatefulDataLoader``: trusted without a call. Its ``state_dict()`` asked before an
  iteration builds the iterator, which starts the workers of a loader with ``num_workers > 0``.
* any other loader with both methods: one ``state_dict()`` call, whose result is thrown away; a loader
  whose ``state_dict()`` raises is not resumable.
"""

from __future__ import annotations

from typing import Any

_RESUMABLE_HINT = ("wrap a torchdata StatefulDataLoader (pip install 'gpufeed[resume]') or a "
                   "gpufeed.SourceLoader to save and resume the position")


def _real_type(loader: Any) -> type:
    # type(), not loader.__class__: accelerate's loaders report the class of the DataLoader they wrap there.
    return type(loader)


def _accelerate_adapter(cls: type) -> bool:
    """Whether ``cls`` is one of accelerate's DataLoader adapters (DataLoaderShard, DataLoaderDispatcher,
    SkipDataLoader), told without importing accelerate."""
    return any(c.__name__ == "DataLoaderAdapter" and c.__module__.startswith("accelerate")
               for c in cls.__mro__)


def _torchdata_stateful(cls: type) -> bool:
    return any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata")
               for c in cls.__mro__)


def why_not_resumable(loader: Any) -> str | None:
    """None when ``loader``'s state can be taken and loaded; else one line saying why not and what to do.

    Examples:
        >>> why_not_resumable([1, 2, 3]) is None
        False
    """
    cls = _real_type(loader)
    name = cls.__name__
    if _accelerate_adapter(cls):
        # Read from the instance itself: accelerate's __getattr__ would ask the wrapped DataLoader instead.
        if not vars(loader).get("use_stateful_dataloader", False):
            return (f"accelerate's {name} takes its state only with use_stateful_dataloader=True "
                    "(Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)), "
                    "needs torchdata); without it CudaPrefetcher still delivers its batches but cannot save "
                    "or resume the position")
        return _probe(loader, f"accelerate's {name}")
    state_dict = getattr(loader, "state_dict", None)
    load_state_dict = getattr(loader, "load_state_dict", None)
    if not callable(state_dict) or not callable(load_state_dict):
        missing = "state_dict()" if not callable(state_dict) else "load_state_dict()"
        if not callable(state_dict) and not callable(load_state_dict):
            missing = "state_dict()/load_state_dict()"
        return f"{_article(name)} {name} has no {missing}: {_RESUMABLE_HINT}"
    if _torchdata_stateful(cls):
        return None  # not probed: state_dict() before an iteration would start its workers
    return _probe(loader, f"the {name}")


def _probe(loader: Any, what: str) -> str | None:
    try:
        loader.state_dict()
    except Exception as e:  # the reason is the answer; the loader is left as it was
        detail = str(e).splitlines()[0] if str(e) else ""
        return (f"{what}'s state_dict() raised {type(e).__name__}" + (f" ({detail})" if detail else "")
                + f": {_RESUMABLE_HINT}")
    return None


def _article(name: str) -> str:
    return "an" if name[:1].lower() in "aeiou" else "a"


def take_state(loader: Any) -> tuple[Any, str | None]:
    """``loader.state_dict()`` right after a batch, or None and why it cannot be taken (a probe that passed
    does not prove every later call does: the first refusal ends the taking, and says why)."""
    try:
        return loader.state_dict(), None
    except Exception as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        return None, (f"the {type(loader).__name__}'s state_dict() raised {type(e).__name__}"
                      + (f" ({detail})" if detail else "") + f": {_RESUMABLE_HINT}")
