"""Megatron-LM flags an import reads past: they set data, tokenizer, logging, checkpoints, the
learning-rate schedule, evaluation or start-up, not the step time of the job echo-plan simulates.
(Flags that change the step or its memory (--moe-shared-expert-overlap, --first-last-layers-bf16,
--num-distributed-optimizer-instances, ...) are not here, so they are refused. Names from Megatron-LM's ``megatron/training/arguments.py``.) A flag in neither this list nor
``megatron_lm.FLAGS`` is refused on import, since it may change the job."""

IGNORED_FLAGS = frozenset("""
--data-path --train-data-path --valid-data-path --test-data-path --data-cache-path --split --mock-data
--data-args-path --per-split-data-args-path --num-dataset-builder-threads --no-mmap-bin-files --dataloader-type
--num-workers --tokenizer-type --tokenizer-model --vocab-file --merge-file --tokenizer-prompt-format
--make-vocab-size-divisible-by --legacy-tokenizer --tiktoken-pattern
--train-iters --train-samples --exit-interval --exit-duration-in-mins --exit-signal-handler
--lr --min-lr --lr-decay-style --lr-decay-iters --lr-decay-samples --lr-warmup-iters --lr-warmup-samples
--lr-warmup-fraction --lr-warmup-init --lr-wsd-decay-style --lr-wsd-decay-iters --lr-wsd-decay-samples
--weight-decay --start-weight-decay --end-weight-decay --weight-decay-incr-style --clip-grad
--adam-beta1 --adam-beta2 --adam-eps --sgd-momentum --optimizer --init-method-std --seed
--loss-scale --initial-loss-scale --min-loss-scale --loss-scale-window --hysteresis
--log-interval --log-params-norm --log-num-zeros-in-grad --log-throughput --log-timers-to-tensorboard
--log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-world-size-to-tensorboard
--log-loss-scale-to-tensorboard --log-progress --timing-log-level --timing-log-option --tensorboard-dir
--tensorboard-log-interval --tensorboard-queue-size --wandb-project --wandb-exp-name --wandb-save-dir
--wandb-entity --logging-level --one-logger-project --no-one-logger --record-memory-history
--eval-iters --eval-interval --skip-train --test-mode
--save --load --save-interval --no-save-optim --no-save-rng --no-load-optim --no-load-rng --finetune
--ckpt-format --ckpt-fully-parallel-save --ckpt-fully-parallel-load --async-save --use-dist-ckpt
--auto-detect-ckpt-format --ckpt-assume-constant-structure --dist-ckpt-strictness --pretrained-checkpoint
--non-persistent-save-interval --non-persistent-ckpt-type --use-checkpoint-args --exit-on-missing-checkpoint
--distributed-backend --distributed-timeout-minutes --local-rank --use-mcore-models --transformer-impl
--no-persist-layer-norm --no-create-attention-mask-in-dataloader --manual-gc --manual-gc-interval
--manual-gc-eval --check-for-nan-in-loss-and-grad --no-check-for-nan-in-loss-and-grad --check-weight-hash-across-dp-replicas-interval
--rotary-base --rotary-seq-len-interpolation-factor --use-rope-scaling --rope-scaling-factor --rotary-scaling-factor
--norm-epsilon --init-method-xavier-uniform --attention-softmax-in-fp32 --no-rope-fusion --apply-query-key-layer-scaling
--moe-router-load-balancing-type --moe-aux-loss-coeff --moe-z-loss-coeff --moe-router-enable-expert-bias
--moe-router-bias-update-rate --moe-router-topk-scaling-factor --moe-router-pre-softmax --moe-router-dtype
--moe-input-jitter-eps --moe-token-drop-policy  --moe-per-layer-logging
--moe-router-fusion --mtp-loss-scaling-factor
--cross-entropy-loss-fusion --cross-entropy-fusion-impl --deterministic-mode
--enable-ft-package --calc-ft-timeouts  --ddp-average-in-collective
--ddp-bucket-size --no-check-for-nan-in-grad --fp8-amax-history-len --fp8-amax-compute-algo --fp8-margin
--fp8-interval 
--profile --profile-step-start --profile-step-end --profile-ranks --use-pytorch-profiler --nvtx-ranges
--straggler-detector-enabled --straggler-minmax-count --result-rejected-tracker-filename
""".split())
