"""ops.launch_cache.LaunchCache: built once per key, least recently used out first, counted by kind."""

import pytest

from ops.launch_cache import LaunchCache


def test_an_entry_is_built_once_and_the_least_recently_used_goes_first():
    cache = LaunchCache(max_entries=2)
    builds = []

    def build(name):
        return lambda: builds.append(name) or name

    assert cache.get_or_build(("plan", 1), build("a")) == "a"
    assert cache.get_or_build(("plan", 1), build("again")) == "a"  # taken, not built
    cache.get_or_build(("write", 2), build("b"))
    cache.get_or_build(("plan", 1), build("again"))  # used last: ("write", 2) is now the oldest
    cache.get_or_build(("call", 3), build("c"))  # past max_entries: the oldest goes
    assert len(cache) == 2 and builds == ["a", "b", "c"]
    assert cache.get_or_build(("write", 2), build("b2")) == "b2"  # gone: built again
    assert cache.get_or_build(("call", 3), build("again")) == "c"
    assert cache.hits == {"plan": 2, "call": 1} and cache.misses == {"plan": 1, "write": 2, "call": 1}
    cache.clear()
    assert len(cache) == 0 and cache.get_or_build(("call", 3), build("c2")) == "c2"


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_max_entries_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"LaunchCache: max_entries must be a positive int; got"):
        LaunchCache(max_entries=bad)
