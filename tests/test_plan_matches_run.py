"""The planner compiles the train step a run compiles: what train/loop.py passes to compile_steps
(LoRA's trainable filter, above all) the plan passes too."""

from paxlite.experiments.build import load_experiment
from paxlite.planner.search import compile_train_step


def test_a_lora_plan_keeps_adam_state_for_the_adapters_only():
    experiment = load_experiment("paxlite.experiments.tiny.TinyLLaMA", (
        "USE_LORA=True", "LORA_RANDOM_BASE=True", "LORA_RANK=2", "ICI_MESH_SHAPE=[8,1,1]"))
    memory = compile_train_step(experiment, num_devices=8).memory
    # Adam's two moments of every parameter would be twice the parameters (the run's full
    # fine-tuning); of rank-2 adapters on a d_model-32 model, a small fraction of them
    assert 0 < memory.optimizer_state_bytes < memory.parameter_bytes / 2, memory
    # and XLA's own arguments: parameters + the adapters' state + the batch, not + 2x parameters
    assert memory.argument_bytes < 2 * memory.parameter_bytes, memory
