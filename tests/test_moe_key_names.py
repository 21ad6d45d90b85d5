"""The names other MoE trainers give the mixture-of-experts keys (transformers' Mixtral/Qwen2-MoE/DeepSeek
config.json, Megatron-LM's and DeepSpeed-MoE's flags), as a user coming from them writes them first: each is
answered with ours. `num_experts_per_tok` (transformers' top-k) was answered 'did you mean model.num_experts?',
which sets the number of experts to the top-k."""
import pytest

from shardlm.config import ConfigError, load_config
from shardlm.config.load import refuse_misplaced_train_args


@pytest.mark.parametrize("key, ours", [
    ("model.num_experts_per_tok", "model.top_k"),
    ("model.num_local_experts", "model.num_experts"),
    ("model.n_routed_experts", "model.num_experts"),
    ("model.moe_intermediate_size", "model.moe_ffn_hidden_size"),
    ("model.shared_expert_intermediate_size", "model.shared_expert_ffn_hidden_size"),
    ("model.norm_topk_prob", "model.router_renormalize"),
    ("model.decoder_sparse_step", "model.moe_every"),
    ("model.first_k_dense_replace", "model.moe_first_dense"),
    ("model.scoring_func", "model.router_scoring"),
    ("model.router_aux_loss_coef", "train.moe_aux_loss_coef"),
    ("model.router_z_loss_coef", "train.moe_z_loss_coef"),
    ("model.moe_router_topk", "model.top_k"),
    ("model.moe_expert_capacity_factor", "model.capacity_factor"),
    ("model.moe_router_bias_update_rate", "model.router_bias_update_rate"),
    ("model.moe_router_score_function", "model.router_scoring"),
    ("model.moe_shared_expert_intermediate_size", "model.shared_expert_ffn_hidden_size"),
    ("train.moe_aux_loss_coeff", "train.moe_aux_loss_coef"),
    ("train.moe_z_loss_coeff", "train.moe_z_loss_coef"),
    ("parallel.expert_model_parallel_size", "parallel.ep"),
    ("parallel.ep_size", "parallel.ep"),
])
def test_another_trainers_moe_key_is_answered_with_ours(key, ours):
    with pytest.raises(ConfigError) as e:
        load_config("mixtral-tiny", {key: "1"})
    assert f"'s {key.partition('.')[2]} is {ours}" in str(e.value), str(e.value)


@pytest.mark.parametrize("flag, ours", [("--moe-router-topk", "--model.top_k"),
                                        ("--expert-model-parallel-size", "--parallel.ep"),
                                        ("--num-experts-per-tok", "--model.top_k")])
def test_a_megatron_flag_without_its_section_names_ours(flag, ours):
    with pytest.raises(ConfigError) as e:
        refuse_misplaced_train_args([flag, "2"])
    assert f"config keys are written with their section: {ours}" in str(e.value), str(e.value)
