"""``rapidspec bench serve``: load an OpenAI-compatible server over HTTP and summarize what it did.

* :mod:`.dataset`: the requests (built-in document questions, a file's items,
  LoCoMo conversations as multi-turn sessions);
* :mod:`.client`: one request, streamed, timed token by token;
* :mod:`.load`: the load (request rate, concurrency, sessions, disconnects);
* :mod:`.stats`: TTFT, TPOT, ITL and end-to-end percentiles, throughput;
* :mod:`.process`: a ``rapidspec serve`` process started for the run;
* :mod:`.peer`: the same load on llama.cpp's ``llama-server`` (``--peer llama.cpp``);
* :mod:`.vllm_peer`: the same load on vLLM's OpenAI server, three ways (``--peer vllm``).

HTTP only: importing this package loads neither torch nor FastAPI (a test checks).
"""

#: Servers ``--peer`` can start and load after rapidspec's run.
PEERS = ("llama.cpp", "vllm")
