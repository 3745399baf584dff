"""A plugin pass that counts the call targets of every compiled graph at one place in the pass order."""

import collections
import contextlib

from dispatcher import plugins
from dispatcher.passes import GraphPass


class CountAfter(GraphPass):
    """Counts the call targets of the graphs it sees, over every piece and compile."""

    def __init__(self, name):
        self.name = name
        self.counts = collections.Counter()

    def __call__(self, graph, size):
        self.counts.update(n.target for n in graph.nodes if n.op == "call_function")
        return 0


@contextlib.contextmanager
def counted_after(anchor):
    """The targets' counts of every graph compiled in the block, right after pass ``anchor`` (a plugin pass,
    added for the block)."""
    counter = CountAfter(f"count_after_{anchor}")
    plugins.add_post_grad_pass(counter, after=anchor)
    try:
        yield counter.counts
    finally:
        plugins.remove_post_grad_pass(counter.name)
