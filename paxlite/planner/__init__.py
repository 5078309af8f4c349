"""The dry-run planner: compile a run's own train step ahead of time for the CPU or a GPU target
(`search`), read its memory, try the levers that would make it fit (`levers`) and report (`report`);
`plan` finds the devices and puts one plan together."""
