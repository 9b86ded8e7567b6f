"""Plugin name, tag names and the versioned summary metadata of NaN Watch data.

Every summary NaN Watch writes is a TENSOR-class summary whose metadata names
the plugin ``nanwatch`` and carries a small JSON document
``{"version": FORMAT_VERSION, "kind": <kind>}`` as plugin content. The reader
refuses kinds and versions it does not know instead of guessing.

The tags are designed so that TensorBoard's ingestion sampling (10 tensors per
tag on the Python loader, 100 on the Rust data server, always keeping the
latest value) can never drop what matters:

* ``nanwatch/run`` holds the whole run summary (first non-finite step, origin,
  explosion onset, skipped steps, the stats schema). It is rewritten at every
  flush; only its latest value is read, and the latest value is always kept.
* ``nanwatch/series/<chunk>`` holds ``CHUNK_STEPS`` consecutive steps of the
  compact per-step series: one tag per chunk, so every step survives.
* ``nanwatch/layers/<step>`` holds one full per-layer stats vector (a
  periodic snapshot), one tag per snapshot.
* ``nanwatch/incident`` and ``nanwatch/flight`` are written once, when the
  incident is detected: the diagnosis and the flight-recorder window.
"""

from __future__ import annotations

import json

PLUGIN_NAME = "nanwatch"
FORMAT_VERSION = 1

TAG_RUN = "nanwatch/run"
TAG_INCIDENT = "nanwatch/incident"
TAG_FLIGHT = "nanwatch/flight"
TAG_SERIES_PREFIX = "nanwatch/series/"
TAG_LAYERS_PREFIX = "nanwatch/layers/"

KIND_RUN = "run"
KIND_INCIDENT = "incident"
KIND_FLIGHT = "flight"
KIND_SERIES = "series"
KIND_LAYERS = "layers"
KINDS = (KIND_RUN, KIND_INCIDENT, KIND_FLIGHT, KIND_SERIES, KIND_LAYERS)

# The largest step the records hold: the largest integer a JSON number holds
# exactly (the run summary and the routes carry steps as JSON numbers).
MAX_STEP = 2**53 - 1

# Number of consecutive steps stored in one ``nanwatch/series/<chunk>`` tag.
CHUNK_STEPS = 1024


def series_tag(chunk_index: int) -> str:
    return f"{TAG_SERIES_PREFIX}{chunk_index:07d}"


def layers_tag(step: int) -> str:
    return f"{TAG_LAYERS_PREFIX}{step:010d}"


def plugin_content(kind: str) -> bytes:
    """The plugin content of a NaN Watch summary of the given kind."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return json.dumps({"version": FORMAT_VERSION, "kind": kind}).encode("utf-8")


def parse_plugin_content(content: bytes) -> dict:
    """Parses plugin content; raises ValueError for unknown versions or kinds."""
    try:
        parsed = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"unreadable nanwatch plugin content: {error}") from None
    if not isinstance(parsed, dict) or parsed.get("kind") not in KINDS:
        raise ValueError(f"unknown nanwatch summary kind in {parsed!r}")
    version = parsed.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ValueError(f"unsupported nanwatch format version {version!r}")
    return parsed
