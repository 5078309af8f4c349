"""What checkpoint directories hold, in one home that both train/ (saving and resuming runs) and
interop/ (converting models) import: the Orbax run checkpoints (`checkpoint`), how damage and
mismatches are told apart (`checkpoint_damage`, `checkpoint_match`), the optimizer-state layout,
Pax's layout, parameter-only checkpoints (`pretrained`) and the streamed readers and writers."""
