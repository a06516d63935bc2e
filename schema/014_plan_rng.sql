-- 014_plan_rng: plans.rng names the random stream a plan's masks are drawn from (DARE, DELLA;
-- methods.RNG, kernels.py). A plan's hash does not hold it, and mergedb drew from splitmix64 before
-- commit b3b45c5 and from Threefry-2x32-20 since, so a DARE plan made by an older mergedb executed
-- to other bytes under the same hash, silently (a manifest's replay refused already: manifests name
-- their stream). Execution now refuses a plan that draws, when its stream is not the executor's.
-- Existing plans: every mergedb that knows schema 009 or later draws from Threefry (and an older
-- one cannot open such a catalog), so a plan made after the catalog first reached a version >= 009
-- gets its name; other plans keep NULL, their stream unknown. "After": plans.created and
-- schema_version.applied_at are local times of the processes that wrote them (current_timestamp in
-- that process's time zone), so a plan counts only from 26 hours on (the widest gap between two
-- zones' clocks); versions this upgrade applies (stamped with this transaction's own
-- current_timestamp) do not count, since every plan predates them.

ALTER TABLE plans ADD COLUMN rng VARCHAR;

UPDATE plans SET rng = 'threefry2x32-20'
WHERE created >= (
    SELECT min(applied_at) FROM schema_version
    WHERE version >= 9 AND applied_at <> CAST(current_timestamp AS TIMESTAMP)
) + INTERVAL 26 HOUR;
