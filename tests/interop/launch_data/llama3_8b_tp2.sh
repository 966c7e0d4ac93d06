# echo-plan: llama3-8b, tp2 pp1 dp4 mbs1 sp, stack megatron-core, 8 GPUs
# A timing run on mock data; for real training replace --mock-data, --tokenizer-type and --vocab-size
# with your data and tokenizer, and set --train-iters and the learning-rate schedule.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NVTE_FLASH_ATTN=0
export NVTE_FUSED_ATTN=1
torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py \
    --num-layers 32 \
    --hidden-size 4096 \
    --ffn-hidden-size 14336 \
    --num-attention-heads 32 \
    --group-query-attention \
    --num-query-groups 8 \
    --seq-length 8192 \
    --max-position-embeddings 8192 \
    --vocab-size 128256 \
    --swiglu \
    --normalization RMSNorm \
    --position-embedding-type rope \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 1 \
    --context-parallel-size 1 \
    --sequence-parallel \
    --micro-batch-size 1 \
    --global-batch-size 64 \
    --bf16 \
    --attention-backend fused \
    --hidden-dropout 0.0 \
    --attention-dropout 0.0 \
    --tp-comm-overlap \
    --overlap-grad-reduce \
    --accumulate-allreduce-grads-in-fp32 \
    --mock-data --tokenizer-type NullTokenizer \
    --train-iters 50 --lr 3e-4 --log-interval 1 --eval-iters 0
