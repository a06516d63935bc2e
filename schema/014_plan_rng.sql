-- 014_plan_rng: plans.rng names the random stream a plan's masks are drawn from (DARE, DELLA;
-- methods.RNG, kernels.py). A plan's hash does not hold it, and mergedb drew from splitmix64 before
-- commit b3b45c5 and from Threefry-2x32-20 since, so a DARE plan made by an older mergedb executed
-- to other bytes under the same hash, silently (a manifest's replay refused already: manifests name
-- their stream). Execution now refuses a plan that draws, when its stream is not the executor's.
-- Existing plans: every mergedb that knows schema 009 draws from Threefry (and an older one cannot
-- open a catalog at 009), so plans made after this catalog reached 009 get its name; plans made
-- before keep NULL, their stream unknown. (Both times come from current_timestamp: a catalog
-- migrated past 009 just now has all its plans before it.)

ALTER TABLE plans ADD COLUMN rng VARCHAR;

UPDATE plans SET rng = 'threefry2x32-20'
WHERE created >= (SELECT applied_at FROM schema_version WHERE version = 9);
