package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// sqlCmd is `watermill-inbox sql migrate|grants`: the tables of the database/sql store
// (middleware/sqlstore) on PostgreSQL or MySQL/MariaDB.
func sqlCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "sql",
		Short: "Operate the tables of the database/sql store (sqlstore) on PostgreSQL or MySQL/MariaDB",
	}
	cmd.AddCommand(sqlMigrateCmd(), sqlGrantsCmd())
	return cmd
}

type sqlFlags struct {
	storeFlags
	dialect     string
	withOutbox  bool
	outboxTopic string
}

func (f *sqlFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.dialect, "dialect", "", "the database: postgres or mysql (required)")
	cmd.Flags().StringVar(&f.databaseURL, "database-url", "", "data source name: a PostgreSQL URL, or go-sql-driver's user:pass@tcp(host:3306)/db (default $INBOX_DATABASE_URL, then $DATABASE_URL)")
	cmd.Flags().StringVar(&f.schema, "schema", "", "PostgreSQL schema (default public) or MySQL database (default: the connection's)")
	cmd.Flags().StringVar(&f.table, "table", sqlstore.DefaultTable, "inbox table name")
	cmd.Flags().BoolVar(&f.withOutbox, "outbox", false, "also the outbox table (package middleware/outbox) in the same schema or database")
	cmd.Flags().StringVar(&f.outboxTopic, "outbox-topic", "", "the outbox topic (default "+outbox.DefaultTopic+")")
}

// outboxConfig is the outbox configuration of the flags, checked (a usage error otherwise).
func (f *sqlFlags) outboxConfig() (outbox.Config, error) {
	cfg := outbox.Config{Schema: f.schema, Topic: f.outboxTopic}
	if cfg.Topic == "" {
		cfg.Topic = outbox.DefaultTopic
	}
	if err := cfg.Validate(); err != nil {
		return cfg, usageError{err}
	}
	return cfg, nil
}

// outboxSchemaSQL is the outbox table's script for the dialect: outbox.SchemaSQL on
// PostgreSQL, outbox.MySQLSchemaSQL on MySQL.
func outboxSchemaSQL(d sqlstore.Dialect, cfg outbox.Config) (string, error) {
	if d == sqlstore.MySQL {
		return outbox.MySQLSchemaSQL(cfg)
	}
	return outbox.SchemaSQL(cfg)
}

// initializeOutbox creates the outbox table for the dialect: on MySQL through db
// (outbox.InitializeMySQLSchema); on PostgreSQL through a pgx pool on url, which
// outbox.InitializeSchema takes.
func initializeOutbox(ctx context.Context, d sqlstore.Dialect, db *sql.DB, url string, cfg outbox.Config) error {
	if d == sqlstore.MySQL {
		return outbox.InitializeMySQLSchema(ctx, db, cfg)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	return outbox.InitializeSchema(ctx, pool, cfg)
}

// config returns the store configuration the flags name, or a usage error.
func (f *sqlFlags) config() (sqlstore.Config, error) {
	cfg := sqlstore.Config{Schema: f.schema, Table: f.table}
	switch f.dialect {
	case "postgres":
		cfg.Dialect = sqlstore.PostgreSQL
	case "mysql":
		cfg.Dialect = sqlstore.MySQL
	default:
		return cfg, usageError{fmt.Errorf("--dialect %q: want postgres or mysql", f.dialect)}
	}
	if _, err := sqlstore.MigrationSQL(cfg); err != nil {
		return cfg, usageError{err} // invalid names, reported before connecting
	}
	return cfg, nil
}

func sqlMigrateCmd() *cobra.Command {
	var f sqlFlags
	var print bool
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply sqlstore's migrations for the dialect, or print them with --print",
		Long: "Applies the pending migrations of the database/sql store under a lock (safe when several\n" +
			"instances run it at once; on MySQL each DDL statement commits on its own). With --print,\n" +
			"writes the SQL script to standard output without connecting.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.config()
			if err != nil {
				return err
			}
			var ocfg outbox.Config
			if f.withOutbox {
				if ocfg, err = f.outboxConfig(); err != nil {
					return err
				}
			}
			if print {
				script, err := sqlstore.MigrationSQL(cfg)
				if err != nil {
					return err
				}
				if f.withOutbox {
					ob, err := outboxSchemaSQL(cfg.Dialect, ocfg)
					if err != nil {
						return err
					}
					script += ob
				}
				_, err = fmt.Fprint(cmd.OutOrStdout(), script)
				return err
			}
			url := f.url()
			if url == "" {
				return usageError{errors.New("no database URL: pass --database-url or set INBOX_DATABASE_URL")}
			}
			db, err := sqlstore.Open(cmd.Context(), cfg.Dialect, url)
			if err != nil {
				return fmt.Errorf("connect: %w", err)
			}
			defer func() { _ = db.Close() }()
			s, err := sqlstore.New(db, cfg)
			if err != nil {
				return err
			}
			applied, err := s.Migrate(cmd.Context())
			if err != nil {
				return err
			}
			if len(applied) == 0 {
				_, err = fmt.Fprintf(cmd.OutOrStdout(), "%s: up to date\n", s.Table())
			} else {
				_, err = fmt.Fprintf(cmd.OutOrStdout(), "%s: applied migrations %v\n", s.Table(), applied)
			}
			if err != nil || !f.withOutbox {
				return err
			}
			if err := initializeOutbox(cmd.Context(), cfg.Dialect, db, url, ocfg); err != nil {
				return err
			}
			_, err = fmt.Fprintf(cmd.OutOrStdout(), "outbox table for topic %s: present\n", ocfg.Topic)
			return err
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&print, "print", false, "print the SQL script instead of applying it")
	return cmd
}

func sqlGrantsCmd() *cobra.Command {
	var f sqlFlags
	var user string
	cmd := &cobra.Command{
		Use:   "grants",
		Short: "Print the GRANT statements a least-privileged user needs for sqlstore's tables",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.config()
			if err != nil {
				return err
			}
			script, err := sqlstore.GrantSQL(cfg, user)
			if err != nil {
				return usageError{err}
			}
			if f.withOutbox {
				ocfg, err := f.outboxConfig()
				if err != nil {
					return err
				}
				grant := outbox.GrantSQL
				if cfg.Dialect == sqlstore.MySQL {
					grant = outbox.MySQLGrantSQL
				}
				ob, err := grant(ocfg, user)
				if err != nil {
					return usageError{err}
				}
				script += ob
			}
			_, err = fmt.Fprint(cmd.OutOrStdout(), script)
			return err
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&user, "user", "", "the PostgreSQL role or MySQL user (required)")
	return cmd
}
