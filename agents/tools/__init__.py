"""Server tools: functions the runtime runs itself, shown to clients as ``agent_runtime:function_call`` items.

``registry`` (what a tool is, the registry, running one) imports no model; ``knowledge`` holds the built-in
knowledge search, over ``search`` (full-text search of an instance's documents in the database).
"""
