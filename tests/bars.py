"""A stand-in for :func:`moejax.extras.progress` that keeps what a computation tells each of
its bars: its settings, how much it counted and whether it was closed."""


class Bars:
    """``monkeypatch.setattr(module, "progress", bars := Bars())``; ``bars.made``: the bars."""

    def __init__(self):
        self.made: list[Bar] = []

    def __call__(self, iterable=None, **kw):
        bar = Bar(iterable, kw)
        self.made.append(bar)
        return bar


class Bar:
    def __init__(self, iterable, kw: dict):
        self.iterable, self.kw, self.done, self.closed = iterable, kw, 0, False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.done += 1
        self.closed = True  # tqdm closes a bar its iteration ends

    def update(self, n: int = 1):
        self.done += n

    def close(self):
        self.closed = True
