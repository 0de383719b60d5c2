"""Two-process (DDP, gloo on CPU) JetSpec head training, launched by tests/test_training.py::test_ddp_two_processes.

Usage: accelerate launch --num_processes 2 --cpu tests/ddp_train_script.py OUTPUT_DIR

Every rank writes OUTPUT_DIR/rank{r}.json with the world size, a hash of its head weights after training and its
evaluation metrics; rank 0 also saves the head to OUTPUT_DIR/final.
"""

import hashlib
import json
import os
import sys

import torch

from jetspec_hf.training import JetSpecTrainer, JetSpecTrainingArguments

from tiny_models import CPU_TRAINING, VOCAB, tiny_head, tiny_target  # the script's folder, tests/, is on sys.path


def main(output_dir: str) -> None:
    # the same (seeded) target and initial head on every rank
    target = tiny_target("llama", logit_scale=1.0, max_position_embeddings=256, initializer_range=0.2)
    head = tiny_head(target, block_size=4, num_hidden_layers=1, max_position_embeddings=256)
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(8):
        input_ids = torch.randint(0, VOCAB - 1, (16,), generator=generator)
        loss_mask = (torch.arange(16) >= 4).long()
        data.append(
            {"input_ids": input_ids, "attention_mask": torch.ones(16, dtype=torch.long), "loss_mask": loss_mask}
        )
    eval_data = data[:5]  # odd: the last eval batch of one rank is padded with a duplicate, which must not count

    args = JetSpecTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        num_anchors=4,
        logging_steps=1,
        **CPU_TRAINING,
    )
    trainer = JetSpecTrainer(head, args, train_dataset=data, eval_dataset=eval_data, target_model=target)
    trainer.train()
    metrics = trainer.evaluate()

    digest = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    rank = trainer.args.process_index
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"world_size": trainer.args.world_size, "sha256": digest.hexdigest(), "eval": metrics}, f)
    trainer.save_model(os.path.join(output_dir, "final"))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
