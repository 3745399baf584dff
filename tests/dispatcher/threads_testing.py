"""Run a test body on several threads at once and re-raise the first failure in the test's thread."""

import threading
from collections.abc import Callable, Sequence
from typing import Any


def run_in_threads(target: Callable[..., Any], args: Sequence[tuple]) -> None:
    """Start one thread per ``args`` tuple calling ``target(*a)``; join all; raise the first error."""
    errors: list[BaseException] = []

    def guarded(*a: Any) -> None:
        try:
            target(*a)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
