"""The engine: ``EngineCore`` (schedule -> runner -> update, in process), the engine-core
process fed over ZMQ (``process``), its socket clients (``client``) and the wire messages
between them (``messages``). Above the scheduler (``schedkit.core``), the plugins and the
runners; below the cluster, ``LLM`` / ``AsyncLLM`` (``schedkit.llm``), the lab and the CLI."""
