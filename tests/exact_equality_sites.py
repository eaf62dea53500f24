"""Every exact-equality site in the tests (tests/exact_equality.py finds them) and why exact is right there (issue 41,
docs/reproducibility.md). Exact equality stays only where no rounding can differ: integers, ids, masks and strings;
values exact in binary; copies, casts and stored round trips; or the same computation again (same kernels, inputs,
batch shapes and threads). Two DIFFERENT computations of floats (another batch shape, chunking, budget, kernel set
or thread count) are compared within tests/tolerances.py's bound instead, never here."""

from __future__ import annotations

INTS = "integers, ids, indices, masks, bools or strings: nothing is rounded"
EXACT = "hand-computed values exact in binary (small integers, halves, powers of two) from exact arithmetic"
COPY = "a copy, a cast or a stored round trip (Arrow, JSON, safetensors, dequantisation): no arithmetic to reorder"
SAME = ("the same computation twice: same kernels, same inputs, same batch shapes and threads, in one process or "
        "one config, so deterministic kernels give the same bits")

# file::function -> (number of sites, reason, what is compared)
SITES: dict[str, tuple[int, str, str]] = {
    "pooled_bounds.py::assert_same_tables": (2, INTS, "schemas and every non-vector column (ids, layers, fallbacks)"),
    "test_alignment_parses.py::test_parses_are_cached_by_corpus_hash_and_reused": (1, INTS, "a cached parse table"),
    "test_batch_budget.py::test_chunks_of_a_batch_hold_what_the_whole_batch_holds_up_to_round_off": (
        1, INTS, "attention masks of the chunks and the whole batch"),
    "test_capture_reads.py::test_a_launch_reads_the_device_only_in_transformers_mask_check": (
        1, SAME + ": transformers' mask check answered from the host says what the device said for a padded "
           "batch (materialise the mask): the same kernels on the same inputs", "every pooled vector, both runs"),
    "test_capture_reads.py::test_host_pairs_are_the_device_pairs_in_their_order": (
        1, INTS, "the log-likelihood's (row, position) indices from the host mask and from the device's nonzero"),
    "test_capture_reads.py::test_on_cuda_a_launch_never_waits_for_the_device": (
        1, SAME + " (on CUDA, the forward's strategies only: S2's go through sdpa's atomic backward and are not "
           "compared)", "the vectors of every strategy but S2, under the sync debug mode and without"),
    "test_learned_pooling.py::test_the_token_keeper_keeps_each_rows_tokens_without_reading_the_device": (
        1, COPY + ": a gather of the same elements and a cast to float32, by flat positions or by a row's mask",
        "each row's kept token states"),
    "test_capture_pipeline.py::_assert_identical": (
        1, SAME + ": finishing a chunk after the next one is enqueued moves host calls in time; the chunks, "
           "kernels and inputs are the same", "every pooled, S3 head and S2 gradient table, overlap on and off"),
    "test_capture_pipeline.py::test_gradient_sums_reach_the_host_through_launched": (
        1, COPY + " of small integers", "S2's gradient sums after GradientTee.launched's copy to the host"),
    "test_gradient_in_backward.py::test_each_layer_equals_autograd_over_every_layer_bit_for_bit": (
        2, SAME + ": S2's forward, LM head and backward run the same kernels on the same inputs; a hook on each "
           "layer's output reads the gradient autograd.grad would capture there", "each layer's states and "
           "gradient extras, written inside the backward against autograd.grad over every layer (CPU)"),
    "test_gradient_in_backward.py::test_on_cuda_the_layers_are_written_in_the_backward_with_autograds_values": (
        1, SAME + " (the forward; the gradients are compared within the bound)",
        "each layer's states on CUDA, in and after the backward"),
    "test_device_staging.py::test_staged_pooling_writes_the_host_only_at_launch_and_the_same_values": (
        3, SAME + ": staged or not, the same kernels write the same values, into device memory first and then one "
           "copy", "pooled vectors, fallback flags, S3's head vectors and outputs, staged and unstaged (CPU)"),
    "test_device_staging.py::test_on_cuda_the_layers_copy_nothing_and_one_copy_goes_on_the_copy_stream": (
        2, SAME + " (on CUDA: the copy a layer on the compute stream, or one on the copy stream)",
        "pooled vectors and fallback flags, staged and unstaged"),
    "test_gradient_sums.py::test_a_bfloat16_layers_norm_sums_are_those_of_its_float32_cast_bit_for_bit": (
        2, SAME + ": the cast to float32 is exact and the norm reduces the same float32 values either way; the "
           "counts are integers", "a bfloat16 layer's norm sums, reduced in float32 or of its float32 copy"),
    "test_device_pool.py::assert_same": (2, INTS + "; head outputs gathered at the last token (a copy)",
                                         "fallback flags, the last token's head outputs"),
    "test_device_pool_ops.py::test_three_bfloat16_parts_hold_float32_weights_exactly": (
        1, EXACT + ": each bfloat16 part is the exact residual of the ones before, and every partial sum of the "
           "parts fits float32's 24 significant bits", "float32 weights and the sum of their bfloat16 parts"),
    "test_host_room.py::test_concepts_pooled_in_layer_passes_get_the_records_of_concepts_pooled_whole": (
        1, SAME + ": a pass pools some of the layers from the same batches (the tiny model's budget is the CPU's "
           "cap, whatever the layers) with the same kernels up to its deepest layer, so each layer's vectors come "
           "from the ops they come from pooled whole; where a pass's budget differs (a GPU) they agree to round-off "
           "(docs/reproducibility.md)", "every D1 record of the run in passes and the run pooled whole"),
    "test_gpu_shaped_run_on_cpu.py::test_the_gpu_plan_with_two_jobs_an_extractor_gives_the_cpu_plans_records": (
        1, SAME + ": the GPU plan on a CPU pools the same batches (one concept a job) with the same kernels on one "
           "thread (the CPU plan's torch_threads 1, the module's OMP_NUM_THREADS 1 for the GPU plan's actor) and "
           "probes one cell a call as the CPU plan does; only where the work runs differs",
        "every D1 record of the two plans"),
    "test_probe_processes.py::test_probe_tasks_with_gpu_shares_on_a_two_gpu_node_each_run_in_a_process_of_their_own": (
        1, SAME + ": the same probe task on the same stored tables, each in a Ray worker computing on one thread; "
           "only the GPU share Ray counts it on (torch sees no GPU) and its process differ",
        "each layer's D1 records, with and without a GPU share"),
    "test_pooled_shards.py::test_shards_written_on_several_threads_are_the_objects_one_thread_writes": (
        1, COPY + ": the same tables encoded and serialised on one thread or three", "the stored files' bytes"),
    "test_store.py::test_a_folder_stores_table_lies_in_its_file_mapped_into_memory": (
        2, COPY + ": a table stored and read back from its mapped file", "the table read, before and after a rewrite"),
    "test_s3_spool.py::test_an_s3_tables_bytes_lie_in_its_spool_file_mapped_into_memory": (
        1, COPY + ": a table uploaded and read back from its mapped spool file", "the table read"),
    "test_store.py::test_a_table_is_stored_as_the_librarys_bytes_in_every_backend": (
        1, COPY, "a stored table read back against the table with its provenance"),
    "test_s3_spool.py::test_an_s3_table_over_a_part_goes_up_in_parts_from_its_spool_and_reads_back_whole": (
        1, COPY, "a table uploaded in parts from its spool file, read back against the table with its provenance"),
    "test_store.py::test_a_table_serialises_to_the_librarys_bytes_in_one_exact_buffer": (
        1, COPY + ": one table serialised by pyarrow's IPC writer into a sized buffer or a growing stream",
        "the serialised bytes"),
    "test_lapack_factors.py::test_factors_in_place_equal_torch_s_and_keep_the_upper_triangle": (
        1, COPY + ": the strict upper triangle LAPACK must leave as it found it, against the input's copy",
        "the matrices' strict upper triangles"),
    "test_attention_inflow.py::assert_records_match": (
        1, COPY + ": both paths gather the layer's own attention output at the last real token, no arithmetic",
        "the last token's head outputs"),
    "test_batched_logistic.py::test_batched_cell_records_equal_todays_evaluate_d1_and_cell_reliability": (
        2, INTS + "; the 0/1 predictions sit further from the threshold than the solvers' stopping-rule bound on this "
           "cell (the same argument as its AUROCs, said beside them)", "fold indices and 0/1 test predictions"),
    "test_batched_logistic.py::test_batched_cell_on_cuda_equals_its_cpu_twin": (
        1, INTS, "the fold that scored each passage, GPU against CPU"),
    "test_diffmean_batched.py::test_a_cell_through_the_device_branch_keeps_every_diffmean_record": (
        2, INTS + "; the 0/1 predictions sit further from 0 than the two paths' round-off on this cell",
        "fold indices and 0/1 test predictions"),
    "test_distinct_rows.py::test_row_hashes_group_rows_as_torch_unique_does": (
        1, COPY + ": each row's group representative gathered back, no arithmetic", "the rows and their gathers"),
    "test_batched_logistic.py::test_a_fit_stopped_at_max_iter_is_flagged_and_warned_and_one_that_met_the_rule_is_not": (
        1, SAME + ": max_iter equal to the steps the fit took runs the same steps on the same inputs",
        "the coefficients of a fit allowed exactly its own steps and of the default one"),
    "test_lm_head_likelihood.py::test_the_plain_head_gradient_is_autograds_bit_for_bit": (
        2, SAME + ": the in-place path runs autograd's own backward formulas elementwise in the same order (exp of "
           "x - lse, negation, + 1 at the target, the cast back, grad @ W), so no rounding is reordered; its "
           "logsumexp_rows reduces each row as torch.logsumexp does, at the two threads the test pins",
        "the chunk's score and gradient, by hand and by autograd"),
    "test_logsumexp_rows.py::test_same_bits_as_torch_at_vocabulary_widths": (
        1, SAME + ": blocks of rows run torch.logsumexp's own ops; a CPU reduces each row alone either way, and at "
           "widths that are multiples of 64 on two threads every thread's share of the exp is whole SIMD vectors",
        "logsumexp_rows and torch.logsumexp"),
    "test_logsumexp_rows.py::test_same_bits_with_one_and_two_threads_and_small_blocks": (
        2, SAME + ": as above, on one and on two threads, float32 and float64", "logsumexp_rows and torch.logsumexp"),
    "test_logsumexp_rows.py::test_infinite_rows_as_torch_gives_them": (
        1, SAME + ": as above; infinite maxes are zeroed before the shift, in torch's order",
        "logsumexp_rows and torch.logsumexp with infinite rows"),
    "test_logsumexp_rows.py::test_other_inputs_are_torchs_own_call": (
        3, SAME + ": a single block, bfloat16 and a strided input are handed to torch.logsumexp itself",
        "logsumexp_rows and torch.logsumexp"),
    "test_reliability.py::test_fold_sets_are_remembered_by_labels_groups_folds_and_seed": (
        1, INTS, "fold indices of the remembered fold sets and scikit-learn's"),
    "test_d1_cell_batches.py::test_a_batch_of_cells_widens_its_rows_once_into_the_stack_and_holds_each_cells_numbers": (
        1, COPY + ": float32 rows widened to float64 (exact) in their slot, against numpy's float64 casts stacked",
        "a batch's float64 rows, built slot by slot and by numpy"),
    "test_s3_supervised.py::test_an_s3_cell_on_the_probes_device_keeps_the_host_cells_heads_and_records": (
        1, INTS + "; every logistic test score sits further from 0 than the solvers' stopping-rule bound (asserted "
           "beside it), DiffMean's are the same host computation", "0/1 test predictions, device path against the "
           "host"),
    "test_batched_logistic.py::test_s3_head_ranking_builds_its_splitter_once_and_keeps_each_heads_auroc": (
        1, SAME + ": the folds of a splitter built once equal those built per head, so each head's fits are the same "
           "computation", "per-head AUROCs"),
    "test_distinct_rows.py::test_equal_rows_get_one_score_wherever_they_sit": (
        1, COPY + ": the numpy and torch paths gather the same distinct rows' scores, computed by the same score "
           "function on the same rows", "the numpy path's scores and the torch path's"),
    "test_distinct_rows.py::test_all_distinct_rows_are_scored_as_given": (
        1, SAME + ": with no repeated row the score runs on X itself", "the scores with and without the gathering"),
    "test_distinct_rows.py::test_small_fits_take_own_grams_else_the_shared_one": (
        2, SAME + ": the path fit_many chose (exact, or the shared Gram after a failed Cholesky) run again by hand",
        "the chosen fits' vectors and the same path's"),
    "test_model_shapes.py::same_weights": (1, SAME + ": the same seed on the same device draws the same weights",
                                           "two shape models' parameters"),
    "test_model_shapes.py::test_a_shape_loads_without_the_embedded_wheel_with_the_same_weights_for_the_same_seed": (
        1, SAME + ": the caller's generator state, drawn from twice", "the caller's random stream"),
    "test_s2_memory.py::test_s2_sub_chunks_join_into_the_plain_chunk": (1, INTS, "array shapes"),
    "test_extractor.py::test_hooks_removed_after_exit_and_on_error": (1, SAME, "logits before and after hooks"),
    "test_extractor.py::test_add_hooks_edits_the_residual_stream": (1, SAME, "logits with no-op hooks and none"),
    "test_extractor.py::test_tuple_returning_blocks": (5, EXACT, "a toy block's outputs (3, 10, 1)"),
    "test_extractor.py::test_extracted_hidden_matches_unbatched_forward": (1, INTS, "input ids"),
    "test_flash.py::test_flash_subset_keeps_pairs_and_balance": (2, INTS, "row indices"),
    "test_gguf_checkpoint.py::test_converted_folder_is_a_plain_hf_folder": (1, COPY, "tensors copied from GGUF"),
    "test_gguf_checkpoint.py::test_q8_0_weights_are_the_dequantised_values": (1, COPY, "Q8_0 dequantised weights"),
    "test_job_retried.py::test_cluster_activity_gathers_both_stages": (1, INTS, "job counts and node names"),
    "test_drop_pooled.py::test_dropping_the_vectors_keeps_every_record_and_a_rerun_pools_nothing": (
        3, SAME + ": one config, its vectors deleted after D1 or kept; a rerun reads the stored records",
        "D1 records and per-passage scores of a dropping and a keeping run, and the rerun's records"),
    "test_drop_pooled.py::test_with_room_for_one_concept_the_next_is_pooled_only_once_the_last_ones_vectors_left": (
        1, SAME + ": each concept pooled in a job of its own either way, only later", "D1 records, room or none"),
    "test_drop_pooled.py::test_concepts_pooled_a_layer_a_pass_drop_their_vectors_and_keep_every_record": (
        1, SAME + "; a layer's states do not depend on which other layers are captured",
        "D1 records of concepts pooled a layer a pass and whole"),
    "test_drop_pooled.py::test_a_resumed_run_probes_what_was_left_and_pools_only_the_layers_whose_d1_is_missing": (
        2, SAME + "; a layer's states do not depend on which other layers are captured",
        "D1 records of the resumed runs and a keeping run"),
    "test_pipeline.py::test_a_run_killed_between_layer_shards_recomputes_only_the_missing_ones": (
        1, SAME + "; a layer's states do not depend on which later layers are captured",
        "D1 records of a resumed run and the first"),
    "test_pipeline.py::test_a_corrupt_artifact_is_quarantined_and_recomputed_not_fatal": (
        1, SAME, "D1 records after one shard is recomputed"),
    "test_pool_strategies.py::test_linguistic_strategies_agree_with_pool_naive_and_batch_order": (
        1, INTS, "fallback flags"),
    "test_pool_strategies.py::test_tiny_llama_has_no_sink_so_auto_pools_exactly_as_keep": (
        1, SAME + "; auto's weights are keep's where no sink is found", "pooled matrices, auto vs keep"),
    "test_pooled_shards.py::test_float16_round_trip_is_float32_rounded_to_half": (2, COPY, "float16 casts"),
    "test_pooled_shards.py::test_bfloat16_round_trip_keeps_the_top_half_of_float32_rounded_to_even": (
        1, COPY, "bfloat16 casts"),
    "test_pooled_shards.py::test_probing_layer_by_layer_equals_probing_the_whole_concept": (
        2, SAME + "; D1 is computed per cell", "D1 records of one table probed whole and layer by layer"),
    "test_pooled_shards.py::test_worker_shards_by_layer_a_d1_task_reads_one_and_resume_fills_only_the_gap": (
        6, SAME + "; then a stored round trip or a 16-bit cast", "D1 records, a stored shard, float16 vectors, a "
           "bfloat16 store's D1 records against the same tables rounded in memory, its stored head table"),
    "test_pooled_shards.py::test_a_16_bit_store_holds_s3s_head_vectors_at_16_bits_and_their_outputs_at_32": (
        2, COPY + ": the head vectors rounded to bfloat16 by the store or by torch's cast, the outputs copied",
        "a stored head table's vectors and outputs"),
    "test_pooled_shards.py::test_bfloat16_bits_and_the_float16_range_check_read_in_blocks": (
        1, INTS + ": bfloat16 bit patterns from one integer formula, in blocks or whole", "uint16 bits"),
    "test_pooled_shards.py::test_encoding_a_layer_chunk_by_chunk_equals_converting_its_whole_column": (
        3, COPY + ": float16 and bfloat16 casts of the same values, chunk by chunk or whole, and their decoding back "
           "to float32", "16-bit bits, the other columns, float32 values"),
    "test_pooled_table.py::test_round_trip_places_every_vector": (3, EXACT, "small-integer vectors, labels, flags"),
    "test_pooled_table.py::test_each_layer_owns_a_copy_of_its_rows": (1, COPY, "a layer's vectors and the input's"),
    "test_pooled_table.py::test_head_table_keeps_each_head_at_its_own_width_and_reorders_to_the_pooled_rows": (
        2, EXACT, "small-integer head vectors"),
    "test_pooler.py::test_pool_tokens_equals_pool_naive_on_random_padded_batches": (1, INTS, "fallback flags"),
    "test_pooler.py::test_spec_selecting_no_token_falls_back_to_mean_and_is_flagged": (2, INTS, "fallback flags"),
    "test_pooler.py::test_token_context_rank_ignores_padding_side": (2, INTS, "token ranks and lengths"),
    "test_pooler.py::test_pooled_vectors_do_not_alias_the_hidden_states": (1, COPY, "the hidden states, untouched"),
    "test_pooler.py::test_auto_pools_bit_for_bit_as_keep_where_there_is_no_sink": (
        1, SAME + "; auto's weights are keep's where no sink is found", "pooled vectors, auto vs keep"),
    "test_prober.py::test_diffmean_probe_by_hand": (4, EXACT, "a DiffMean direction and projections"),
    "test_prober.py::test_no_pair_straddles_folds": (1, INTS, "validation indices"),
    "test_prober.py::test_cv_is_deterministic_and_keeps_out_of_fold_scores": (1, SAME, "CV scores, run twice"),
    "test_prober.py::test_bootstrap_resamples_pairs_together": (4, INTS, "bootstrap counts (integer weights)"),
    "test_prober.py::test_perfect_separation_gives_one_and_a_flagged_ci_below_one": (
        2, INTS + "; fold AUROCs of perfect separation are exactly 1", "fold AUROCs, predictions"),
    "test_records.py::test_d1_record_round_trip_through_dict_and_the_stored_arrow_table": (2, COPY, "D1 records"),
    "test_records.py::test_steering_records_round_trip_key_for_key": (1, COPY, "steering records"),
    "test_reliability.py::test_fast_folds_equal_sklearn_stratified_group_kfold": (3, INTS, "fold indices"),
    "test_reliability.py::test_control_labels_hand_computed": (1, INTS, "control labels"),
    "test_request_local_hooks.py::test_another_threads_early_stopping_capture_neither_stops_nor_records_this_forward": (
        1, SAME, "logits with another thread's capture open"),
    "test_request_local_hooks.py::test_another_threads_steering_hook_leaves_this_forward_alone": (
        1, SAME, "hidden states with another thread's hook open"),
    "test_sae.py::test_round_trip": (1, COPY, "SAE weights saved and loaded"),
    "test_sae.py::test_train_sae_is_deterministic_and_learns_a_sparse_dictionary": (
        1, SAME + " (deterministic_cpu fixes seed and threads)", "SAE weights trained twice"),
    "test_sampling.py::test_in_place_noise_is_the_out_of_place_hash_bit_for_bit": (
        3, SAME + "; the in-place and out-of-place forms apply the same elementwise ops to the same values; and an "
        "input against its copy", "uniforms and Gumbel noise, in place against out of place; fmix32's input after"),
    "test_verdicts.py::test_holm_twin_equals_statsmodels_and_a_hand_computation": (
        1, SAME + "; both multiply the same sorted p by the same integers, take the running maximum and cap at 1",
        "Holm-adjusted p, holm_adjusted against statsmodels' multipletests"),
    "test_signed_rank_posterior.py::test_equal_to_baycomp_bit_for_bit": (
        1, SAME + ": the twin draws the same Dirichlet weights from the same RandomState call, forms the same "
           "element-wise outer products and reduces each draw's (n+1)^2 contiguous products with numpy's same "
           "pairwise sum that baycomp's np.sum over the draw's matrix uses", "posterior samples, twin against baycomp"),
    "test_signed_rank_posterior.py::test_blocks_do_not_change_the_sums": (
        2, SAME + ": each draw's row is reduced alone, so the block a draw falls in changes no operation",
        "posterior samples in blocks of one draw and of all, and against baycomp"),
    "test_shared_trunk.py::test_equal_to_each_scorer_alone_with_the_frozen_block_run_once": (
        1, SAME + ": the frozen blocks have equal weights and run on the same batch (same texts, order, padding, "
           "threads) once instead of once per scorer; each scorer's own top block and head then run on those bits",
        "each scorer's probabilities, shared trunk against the scorer alone"),
    "test_shared_trunk.py::test_a_scorer_with_other_frozen_weights_or_no_training_record_is_scored_alone": (
        1, SAME + ": as in the test above, for the scorers that share; the others run exactly ScorerModel.score",
        "each scorer's probabilities, score_texts against the scorer alone"),
    "test_sampling.py::test_a_rows_noise_ignores_its_batch_and_follows_seed_and_step": (
        2, "elementwise noise from integer keys: each entry is its own computation, with no reduction across the "
           "batch", "a row's Gumbel noise alone and in a batch"),
    "test_scorer.py::test_scorer_trains_on_train_split_only_and_is_valid": (1, COPY, "a scorer record via JSON"),
    "test_slot_table.py::test_table_has_the_zero_row_first_and_equal_deltas_share_a_slot": (
        1, COPY, "deltas placed in a table"),
    "test_slot_table.py::test_layer_tables_keep_each_slot_at_its_own_layer": (2, COPY, "deltas placed in tables"),
    "test_slot_table.py::test_tokens_take_their_requests_slot_in_batch_order": (2, INTS, "slot indices"),
    "test_slot_table.py::test_each_token_adds_its_own_requests_delta_only": (
        1, "an unsteered token adds the zero row: x + 0 is x exactly", "unsteered tokens' states"),
    "test_steerer.py::test_hook_removed_and_output_unchanged_afterwards": (1, SAME, "logits before and after"),
    "test_steerer.py::test_planted_direction_steers_with_positive_scp_and_ci_excluding_zero": (
        3, COPY, "a steering record via JSON and the store"),
    "test_steerer.py::test_zero_vector_cell_is_null_not_nan": (1, COPY, "a stored record read back"),
    "test_steerer.py::test_stored_artifact_written_before_records_reads_back": (1, COPY, "an old record read back"),
    "test_steering_cell_groups.py::test_a_group_of_cells_gives_what_each_cell_gives_alone": (
        1, INTS + "; texts (a token flip needs a near-tie of two logits), alphas and the stub scorer's word "
           "shares (exact fractions of small integers)", "generations tables"),
    "test_store.py::test_dir_round_trip": (1, COPY, "file bytes"),
    "test_tiny_model.py::test_two_builds_give_identical_bytes": (
        3, SAME + " (deterministic_cpu fixes seed and threads)", "two builds' files and tensors"),
    "test_tiny_model.py::test_build_restores_global_torch_state": (1, SAME, "the global RNG's next draw"),
    "test_valence_bias.py::test_demo_outcomes_on_a_tiny_model": (
        1, SAME + "; the second run reads the first's stored model", "valence after fine-tuning, cached"),
    "test_vllm_payloads.py::generate": (1, SAME, "tensor-parallel ranks' hidden states (same inputs and weights)"),
    "test_passage_scores.py::test_the_stored_scores_reproduce_every_cell_in_either_store": (
        1, COPY, "the gathered per-passage table against its one layer shard (a concatenation of one table)"),
    "test_passage_scores.py::test_samples_are_read_from_the_table_and_a_broken_table_is_named": (
        1, INTS, "passage ids of the samples and of the stored scores"),
    "test_learned_aggregators.py::"
    "test_a_learned_cell_hands_out_the_fit_of_the_folds_own_passages_and_refuses_any_other": (
        2, COPY, "the stored per-fit vectors a learned cell hands out (a lookup, no arithmetic)"),
    "test_learned_pooling.py::test_a_worker_pools_fits_and_stores_a_learned_strategy_and_d1_probes_it_per_fold": (
        1, COPY, "the PooledTable row and the stored whole-train fit's vectors (one array written twice)"),
    "test_trackers.py::test_mlflow_run_holds_config_leaderboard_answer_and_figures": (
        1, COPY, "the figures' PNG bytes MLflow stored against the ones the adapter handed it"),
    "test_run_axes.py::test_a_run_with_three_sites_and_two_lengths_keeps_the_residual_cells": (
        1, COPY + "; the main variant's keys are unchanged, so its D1 artifacts are the stored ones read again",
        "the residual cells of a run with sites and lengths against a residual-only run's"),
    "test_trackers.py::test_wandb_offline_run_holds_config_leaderboard_answer_and_figures": (
        1, COPY, "the figures' PNG bytes in the W&B offline run against the ones the adapter handed it"),
    "test_trackers.py::test_a_tiny_run_logs_itself_to_both_trackers": (
        1, COPY, "answer.json in the W&B offline run against the run folder's"),
    "test_after_d1_statistics.py::test_pair_resamples_are_drawn_once_read_only_and_equal_to_a_fresh_draw": (
        1, SAME + ": the memo cleared, the same seed's multinomial draws again", "the pair resamples' weights"),
    "test_after_d1_statistics.py::test_same_pair_comparisons_come_in_the_loops_order": (
        1, INTS + "; 'right' is 0, 0.5 or 1", "the comparisons' indices and outcomes against the loop's"),
    "test_after_d1_statistics.py::test_one_lexical_fit_serves_the_baseline_and_every_tier": (
        1, SAME + ": TF-IDF and the logistic fit on the same train texts, a tier's texts scored one by one",
        "the per-tier lexical records with one fit a concept and with a refit per tier"),
    "test_after_d1_statistics.py::test_a_runs_scores_are_one_record_batch_in_the_run_folder": (
        2, COPY + ": Arrow's concatenation into one piece, and the run folder's zstd round trip",
        "the joined score table against the cells' tables, and read back from the run folder"),
}
