"""The environment: one instance per episode, so `expected` belongs to this episode alone."""

import re


class Countdown:
    def reset(self, sample: dict) -> str:
        self.expected = sample["start"] - 1
        self.mistakes = 0
        return sample["prompt"]

    async def step(self, action: str):
        said = re.search(r"-?\d+", action)
        if said and int(said.group()) == self.expected:
            self.expected -= 1
            done = self.expected < 0
            return ("done" if done else "next"), 1.0, done, {"correct": True}
        self.mistakes += 1
        return f"no, say {self.expected}", 0.0, self.mistakes >= 2, {"correct": False}
