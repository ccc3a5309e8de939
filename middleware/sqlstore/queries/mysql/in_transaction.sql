-- 1 while the session is in a transaction (MariaDB 10.3+): 0 before the inbox's COMMIT means
-- the handler ended the transaction (a COMMIT or ROLLBACK statement, a deadlock that rolled
-- it back); the writes that followed were committed on their own.
SELECT @@in_transaction
