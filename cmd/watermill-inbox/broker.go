package main

import (
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
)

// brokerFlags are the postgres broker's topic tables of `migrate` and `grants`: a broker
// configured with NoDDL (adapters/postgres) runs no CREATE TABLE, so its owner creates and
// grants them beforehand.
type brokerFlags struct {
	topics []string
	schema string
}

func (b *brokerFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringSliceVar(&b.topics, "broker-topics", nil, "the postgres broker's topics (comma-separated) whose tables to include")
	cmd.Flags().StringVar(&b.schema, "broker-schema", "", "schema of the broker's topic tables (postgres.Config.Schema; default: the search_path's)")
}

func (b *brokerFlags) cfg() postgres.Config { return postgres.Config{Schema: b.schema} }

// validate checks the topic names before anything connects.
func (b *brokerFlags) validate() error {
	if len(b.topics) == 0 {
		return nil
	}
	_, err := postgres.SchemaSQL(b.cfg(), b.topics...)
	return err
}

// print writes the topic tables' DDL (postgres.SchemaSQL), if any topic was given.
func (b *brokerFlags) print(cmd *cobra.Command) error {
	if len(b.topics) == 0 {
		return nil
	}
	script, err := postgres.SchemaSQL(b.cfg(), b.topics...)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(cmd.OutOrStdout(), "\n-- the postgres broker's topics\n%s", script)
	return err
}

// migrate creates the topic tables (postgres.Migrate), if any topic was given.
func (b *brokerFlags) migrate(cmd *cobra.Command, pool *pgxpool.Pool) error {
	if len(b.topics) == 0 {
		return nil
	}
	if err := postgres.Migrate(cmd.Context(), pool, b.cfg(), b.topics...); err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "postgres broker tables of topics %v are in place\n", b.topics)
	return nil
}

// grants writes the topic tables' GRANT statements (postgres.GrantSQL) to w, if any topic
// was given.
func (b *brokerFlags) grants(w io.Writer, role string) error {
	if len(b.topics) == 0 {
		return nil
	}
	script, err := postgres.GrantSQL(b.cfg(), role, b.topics...)
	if err != nil {
		return err
	}
	_, err = fmt.Fprint(w, script)
	return err
}
