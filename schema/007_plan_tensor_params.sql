-- 007_plan_tensor_params: per (plan, expert, tensor) effective merge values, for plans whose values
-- differ by tensor (PlanRequest.tensor_params: mergekit gradients and filters) or are derived per
-- tensor (SLERP's coefficients from the catalog's norms and inner products).
-- One row per (plan, position, mergeable tensor) of such a plan, holding every value the executor
-- uses there; plans whose values are per expert (plan_experts.weight/coef, plans.params) have none.
-- Effective values rather than the request's overrides: a coefficient depends on every expert's
-- weight for that tensor (linear normalises per tensor) or on catalog statistics (SLERP), so the
-- stored rows are what the executor and the manifest need, whatever the defaults were.

CREATE TABLE plan_tensor_params (
    plan_id    INTEGER NOT NULL,
    position   INTEGER NOT NULL,             -- expert position in the plan (0-based)
    tensor_idx INTEGER NOT NULL,
    weight     DOUBLE NOT NULL,              -- w_k for this tensor (TIES-style sign election weight)
    coef       DOUBLE NOT NULL,              -- c_k on Δ_k in this tensor (linear: w_k/Σw per tensor; SLERP: s1)
    density    DOUBLE,                       -- NULL where the method has no density
    epsilon    DOUBLE,                       -- DELLA
    gamma      DOUBLE,                       -- breadcrumbs
    lam        DOUBLE,                       -- λ of this tensor (one value for all positions); NULL: none
    t          DOUBLE,                       -- SLERP's t of this tensor
    base_scale DOUBLE NOT NULL,              -- factor on θ₀ in this tensor: 1, SLERP s0 + s1
    PRIMARY KEY (plan_id, position, tensor_idx)
);
