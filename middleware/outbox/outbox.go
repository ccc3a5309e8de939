package outbox

import (
	"context"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/sqltx"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// ErrNotPgxTx is returned (wrapping inbox.ErrInvalidConfig) by Outbox.Store when its context
// carries no inbox transaction: neither pgstore's (pgstore.TxFromContext) nor sqlstore's
// (sqlstore.TxFromContext, either dialect). It is a wiring error, not permanent. (The name
// predates sqlstore; it is kept for callers that test for it.)
var ErrNotPgxTx = fmt.Errorf("%w: outbox: no inbox transaction in the context (the inbox must use pgstore or sqlstore)", inbox.ErrInvalidConfig)

// Outbox implements inbox.Outbox with Watermill's components: a watermill-sql v4 Publisher on
// the inbox's transaction (sql.TxFromPgx for pgstore's, sql.TxFromStdSQL for sqlstore's;
// watermill-sql's PostgreSQL schema, or its MySQL queue schema on sqlstore's MySQL dialect),
// decorated by components/forwarder's Publisher,
// so every produced message is inserted, in the inbox transaction, into the one outbox topic
// inside a forwarder envelope naming its destination topic. The rows commit or roll back with
// the claim and the business writes; the Relay publishes them afterwards.
//
// The envelope keeps the message's UUID, payload and metadata (forwarder's JSON envelope: the
// payload base64-encoded, the metadata as a JSON object), and the relay's unwrapping restores
// all three; the outbox row's own uuid column holds a fresh UUID of the envelope.
//
// It is safe for concurrent use: each Store call builds its publisher on its own transaction.
type Outbox struct {
	cfg         Config
	schema      wmsql.DefaultPostgreSQLSchema
	mysqlSchema wmsql.MySQLQueueSchema
	logger      watermill.LoggerAdapter
}

var _ inbox.Outbox = (*Outbox)(nil)

// New returns an Outbox writing to the topic of cfg, or an error wrapping
// inbox.ErrInvalidConfig. A nil logger discards logs; fields that could carry payloads or
// metadata are removed from what Watermill's components log through it. New does not touch
// the database: call InitializeSchema before the first delivery.
func New(cfg Config, logger watermill.LoggerAdapter) (*Outbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Outbox{cfg: cfg, schema: cfg.schemaAdapter(0), mysqlSchema: cfg.mysqlSchemaAdapter(0), logger: redact(logger)}, nil
}

// Config returns the configuration with defaults filled.
func (o *Outbox) Config() Config { return o.cfg }

// Store implements inbox.Outbox: it inserts msgs, enveloped for topic, into the outbox table in
// the inbox transaction ctx carries (pgstore.TxFromContext, or sqlstore.TxFromContext on
// either dialect: MessagesTable on PostgreSQL, MySQLMessagesTable on MySQL), in one INSERT
// statement, in order. It does not commit: the inbox does. The caller's messages are not modified.
//
// Errors: ErrNotPgxTx for a context without an inbox transaction; an *inbox.InvalidKeyError (permanent) for a
// message whose UUID a downstream inbox would refuse (empty, over inbox.MaxKeyBytes, invalid
// UTF-8, NUL); a permanent error for a nil message, an empty topic, or metadata that is not
// valid UTF-8 (the JSON envelope would silently alter it); otherwise watermill-sql's or the
// driver's error, wrapped. Errors name message UUIDs and metadata keys, never payloads or values.
func (o *Outbox) Store(ctx context.Context, topic string, msgs []*message.Message) error {
	exec, schema, table, err := o.target(ctx)
	if err != nil {
		return err
	}
	if topic == "" || !utf8.ValidString(topic) {
		return inbox.Permanent(errors.New("outbox: destination topic must be non-empty valid UTF-8"))
	}
	if len(msgs) == 0 {
		return nil
	}
	copies := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		c, err := outboxCopy(ctx, m)
		if err != nil {
			return err
		}
		copies[i] = c
	}
	sqlPub, err := wmsql.NewPublisher(exec, wmsql.PublisherConfig{
		SchemaAdapter: schema,
		// Refused by watermill-sql on a transaction anyway: CREATE TABLE could commit it.
		AutoInitializeSchema: false,
	}, o.logger)
	if err != nil {
		return fmt.Errorf("outbox: creating the SQL publisher: %w", err)
	}
	pub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: o.cfg.Topic})
	if err := pub.Publish(topic, copies...); err != nil {
		return fmt.Errorf("outbox: inserting %d messages into %s: %w", len(msgs), table, err)
	}
	// The SQL publisher holds nothing but the transaction it was given; Close only marks it
	// closed. The transaction is the inbox's to commit.
	_ = pub.Close()
	return nil
}

// target returns the inbox transaction ctx carries as watermill-sql's executor, the schema
// adapter of its database and the quoted outbox table, or ErrNotPgxTx.
func (o *Outbox) target(ctx context.Context) (wmsql.ContextExecutor, wmsql.SchemaAdapter, string, error) {
	if tx, ok := pgstore.TxFromContext(ctx); ok {
		return wmsql.TxFromPgx(tx), o.schema, o.cfg.MessagesTable(), nil
	}
	tx, postgres, ok := sqltx.From(ctx)
	switch {
	case !ok:
		return nil, nil, "", ErrNotPgxTx
	case postgres:
		return wmsql.TxFromStdSQL(tx), o.schema, o.cfg.MessagesTable(), nil
	}
	return wmsql.TxFromStdSQL(tx), o.mysqlSchema, o.cfg.MySQLMessagesTable(), nil
}

// outboxCopy validates m and returns a copy carrying its UUID, payload and metadata (a non-nil
// map, so the relayed message's metadata is never nil) with ctx as its context, which the SQL
// publisher uses for the INSERT.
func outboxCopy(ctx context.Context, m *message.Message) (*message.Message, error) {
	if m == nil {
		return nil, inbox.Permanent(errors.New("outbox: nil message"))
	}
	if err := inbox.ValidateKey("produced message UUID", m.UUID); err != nil {
		return nil, err
	}
	md := make(message.Metadata, len(m.Metadata))
	for k, v := range m.Metadata {
		if !utf8.ValidString(k) {
			return nil, inbox.Permanent(fmt.Errorf("outbox: produced message %s: a metadata key is not valid UTF-8", m.UUID))
		}
		if !utf8.ValidString(v) {
			return nil, inbox.Permanent(fmt.Errorf("outbox: produced message %s: the value of metadata %q is not valid UTF-8", m.UUID, k))
		}
		md[k] = v
	}
	c := message.NewMessage(m.UUID, m.Payload)
	c.Metadata = md
	c.SetContext(ctx)
	return c, nil
}
