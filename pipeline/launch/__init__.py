"""Launching a stage's processes: one stage on every node (`stage`), each node's command and the rendezvous
(`nodes`), gptforge's own agent on a node (`agent`), what a node does with its address (`on_node`), and a CPU host's
fork server (`fork_server`)."""
