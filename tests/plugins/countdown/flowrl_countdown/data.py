"""The data source: which number each episode counts down from."""

import random


class CountdownData:
    def __init__(self, seed: int = 0, low: int = 3, high: int = 9) -> None:
        self.seed, self.low, self.high = seed, low, high

    def sample(self, step: int, index: int) -> dict:
        # A pure function of (seed, step, index): flowrl may ask again after a crash or a resume.
        rng = random.Random(f"{self.seed}/{step}/{index}")
        start = rng.randint(self.low, self.high)
        return {"start": start, "prompt": f"Count down from {start}, one number per reply."}
