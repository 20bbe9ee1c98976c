"""A weight transport shipped by a plugin package: one module and one `flowrl.transports` entry point,
selected from YAML; the real pipeline trains and its engine receives every version through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = '''
"""Weights through files: each version's buckets saved as safetensors in a folder."""
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from flowrl_operators.transport.base import Stream
from flowrl_operators.transport.registry import Transport


@dataclass(frozen=True)
class FileRecord:
    folder: str
    buckets: int


class FileSender:
    transport = "files"

    def __init__(self):
        self.root = Path(os.environ["ACME_FILES_ROOT"])

    def send(self, buckets, version):
        folder = self.root / f"v{version}"
        folder.mkdir()
        count = 0
        for count, bucket in enumerate(buckets, 1):
            save_file({name: t.contiguous() for name, t in bucket}, str(folder / f"{count}.safetensors"))
        return FileRecord(str(folder), count)

    def wait(self, timeout=None):
        pass

    def close(self):
        pass


class FileStream(Stream):
    transport = "files"

    def __init__(self, record):
        super().__init__()
        self.record, self.index = record, 0

    def _next(self):
        if self.index == self.record.buckets:
            return None
        self.index += 1
        with open(Path(self.record.folder) / "received.log", "a") as f:
            f.write(f"{self.index} ")
        return list(load_file(str(Path(self.record.folder) / f"{self.index}.safetensors")).items())


TRANSPORT = Transport("files", FileRecord, lambda config: FileSender(), lambda record, replica: FileStream(record))
'''


@pytest.fixture
def plugin_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "acme_files").mkdir(parents=True)
    (site / "acme_files/__init__.py").write_text(PLUGIN)
    info = site / "acme_files-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-files\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowrl.transports]\nfiles = acme_files:TRANSPORT\n")
    return site


def flowrl(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "ACME_FILES_ROOT": str(site.parent / "sent")}
    (site.parent / "sent").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_plugin_transport_carries_every_version(plugin_site: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    short = ["run.steps=3", "data.batch_size=2", "nodes.rollout.group_size=2",
             "nodes.rollout.sampling.max_new_tokens=4", "nodes.publish.transport=files"]
    done = flowrl(plugin_site, "run", str(ROOT / "pipelines/grpo_sync.yaml"), *short, "--run-dir", str(run_dir),
                  "--quiet")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    events = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    loaded = sorted(e["version"] for e in events if e["event"] == "consume" and e.get("weights"))
    assert loaded == [1, 2]  # version 3 is the final one: no step is left to generate for
    sent = tmp_path / "sent"
    assert {"v1", "v2"} <= {p.name for p in sent.iterdir()}  # v3 may be sent as the run stops
    for version in ("v1", "v2"):  # every bucket of each delivered version was read back by the engine
        assert (sent / version / "received.log").read_text().split() == \
            [str(i) for i in range(1, len(list((sent / version).glob("*.safetensors"))) + 1)]


def test_an_unknown_transport_is_a_located_error_with_a_suggestion(plugin_site: Path) -> None:
    proc = flowrl(plugin_site, "validate", str(ROOT / "pipelines/grpo_sync.yaml"), "nodes.publish.transport=file")
    assert proc.returncode == 1
    assert "nodes.publish.transport: unknown weight transport 'file'" in proc.stderr
    assert "did you mean 'files'?" in proc.stderr


def test_a_broken_transport_or_engine_entry_costs_only_its_own_name(plugin_site: Path) -> None:
    """Before, one broken entry point made every sync node's check fail (and a training engine's
    made every run fail at setup); now only a spec that names it is refused, at its key."""
    info = plugin_site / "acme_files-0.1.dist-info/entry_points.txt"
    info.write_text(info.read_text() + "broken = acme_files:MISSING\n[flowrl.training_engines]\n"
                                       "broken_engine = acme_files:MISSING\n")
    spec = str(ROOT / "pipelines/grpo_sync.yaml")
    assert flowrl(plugin_site, "validate", spec).returncode == 0
    for override, key in (("nodes.publish.transport=broken", "nodes.publish.transport: weight transport 'broken'"),
                          ("nodes.learner.engine=broken_engine", "nodes.learner.engine: training engine 'broken_engine'")):
        proc = flowrl(plugin_site, "validate", spec, override)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{key} cannot be loaded: " in proc.stderr and "has no attribute 'MISSING'" in proc.stderr, proc.stderr
