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
from transformers import LlamaConfig, LlamaForCausalLM

from jetspec_hf import JetSpecConfig, JetSpecDraftHead
from jetspec_hf.training import JetSpecTrainer, JetSpecTrainingArguments

VOCAB, HIDDEN, LAYERS = 96, 32, 4


def main(output_dir: str) -> None:
    torch.manual_seed(0)  # the same target and initial head on every rank
    target = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.2,
        )
    )
    head = JetSpecDraftHead(
        JetSpecConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            block_size=4,
            num_target_layers=LAYERS,
            target_layer_ids=[0, 2],
            mask_token_id=VOCAB - 1,
            max_position_embeddings=256,
        )
    )
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
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
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
