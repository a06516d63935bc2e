-- 016_base_side_files: checkpoints.side_files lists, as a JSON array of paths relative to root, the
-- side files (config.json, the tokenizer, ...: sidefiles.side_files) a base's folder held when it was
-- last registered. A merged model carries them; `execute` refuses a plan whose base has lost one since
-- (a config.json deleted between register and execute gave an output transformers cannot load, with
-- nothing said). NULL: not recorded (experts, remote bases, bases registered before this version).
-- Registering the base again records its side files as they are then.

ALTER TABLE checkpoints ADD COLUMN side_files VARCHAR;
