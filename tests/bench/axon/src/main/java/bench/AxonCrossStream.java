package bench;

import com.zaxxer.hikari.HikariConfig;
import com.zaxxer.hikari.HikariDataSource;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.Executors;
import java.util.concurrent.atomic.AtomicLong;
import org.axonframework.common.jdbc.ConnectionProvider;
import org.axonframework.common.jdbc.DataSourceConnectionProvider;
import org.axonframework.common.jdbc.UnitOfWorkAwareConnectionProviderWrapper;
import org.axonframework.common.transaction.NoTransactionManager;
import org.axonframework.eventhandling.DomainEventMessage;
import org.axonframework.eventhandling.EventMessage;
import org.axonframework.eventhandling.EventMessageHandler;
import org.axonframework.eventhandling.GenericDomainEventMessage;
import org.axonframework.eventhandling.SimpleEventHandlerInvoker;
import org.axonframework.eventhandling.StreamingEventProcessor;
import org.axonframework.eventhandling.TrackingEventProcessor;
import org.axonframework.eventhandling.TrackingEventProcessorConfiguration;
import org.axonframework.eventhandling.async.PropertySequencingPolicy;
import org.axonframework.eventhandling.async.SequencingPolicy;
import org.axonframework.eventhandling.async.SequentialPerAggregatePolicy;
import org.axonframework.eventhandling.async.SequentialPolicy;
import org.axonframework.eventhandling.pooled.PooledStreamingEventProcessor;
import org.axonframework.eventhandling.tokenstore.jdbc.JdbcTokenStore;
import org.axonframework.eventhandling.tokenstore.jdbc.PostgresTokenTableFactory;
import org.axonframework.eventhandling.tokenstore.jdbc.TokenSchema;
import org.axonframework.eventsourcing.eventstore.jdbc.EventSchema;
import org.axonframework.eventsourcing.eventstore.EmbeddedEventStore;
import org.axonframework.eventsourcing.eventstore.jdbc.JdbcEventStorageEngine;
import org.axonframework.eventsourcing.eventstore.jdbc.PostgresEventTableFactory;
import org.axonframework.messaging.unitofwork.DefaultUnitOfWork;
import org.axonframework.serialization.json.JacksonSerializer;

/**
 * Axon Framework 4.13 draining the cross-stream benchmark's backlog (tests/bench/crossstream.sh
 * runs it beside the engine): STREAMS aggregates x PER_STREAM OrderLine events over CUSTOMERS
 * customers, appended in one unit of work through Axon's JDBC event store, into the same read
 * models (orders: a row per stream; customer_stats: a row per customer; global_stats: one row).
 * Each perspective is a streaming processor of its own whose handler upserts with JDBC on the
 * unit of work's connection, the one that also stores its token: exactly once, as the engine.
 *
 * <p>Settings (environment): SET 0|1|2 (orders; + customer_stats; + global_stats). LAYOUT
 * "recommended" is Axon's default layout for every processor (4 segments, sequencing per
 * aggregate); "expert" keeps it for orders, gives customer_stats a property sequencing policy on
 * the customer and global_stats one segment. PROCESSOR pooled (PooledStreamingEventProcessor,
 * the default, 4 worker threads) or tracking (TrackingEventProcessor, a thread per segment).
 * BATCH: events per transaction of a segment (100; Axon's default is 1). READ_BATCH: events per
 * read of the store (1000). A drain of the same size in a schema of its own warms the JVM up
 * first (WARMUP=0: no warm-up).
 *
 * <p>Prints one line: applies/s (events x perspectives over the time from the backlog's commit to
 * the last apply), PostgreSQL deadlocks, handler failures (each rolls its batch back), whether
 * every model is exact, and "drained" or "timeout".
 */
public final class AxonCrossStream {
  /** The event's payload, serialized as JSON by Axon's Jackson serializer. */
  public static final class OrderLine {
    public String customer;
    public long total;

    public OrderLine() {}

    OrderLine(String customer, long total) {
      this.customer = customer;
      this.total = total;
    }

    public String getCustomer() {
      return customer;
    }
  }

  static final AtomicLong FAILURES = new AtomicLong();

  /** One perspective: its name, its upsert and how its events are sequenced. */
  record Perspective(String name, String setup, String upsert, SequencingPolicy<? super EventMessage<?>> policy, int segments) {}

  /** A handler that runs its upsert on the unit of work's connection. */
  static final class Handler implements EventMessageHandler {
    private final ConnectionProvider connections;
    private final Perspective p;

    Handler(ConnectionProvider connections, Perspective p) {
      this.connections = connections;
      this.p = p;
    }

    @Override
    public Object handle(EventMessage<?> event) throws Exception {
      DomainEventMessage<?> e = (DomainEventMessage<?>) event;
      OrderLine line = (OrderLine) e.getPayload();
      try (Connection c = connections.getConnection();
          PreparedStatement s = c.prepareStatement(p.upsert())) {
        switch (p.name()) {
          case "orders" -> {
            s.setString(1, e.getAggregateIdentifier());
            s.setString(2, line.customer);
            s.setLong(3, line.total);
          }
          case "customer_stats" -> {
            s.setString(1, line.customer);
            s.setLong(2, line.total);
          }
          default -> {}
        }
        s.executeUpdate();
        return null;
      } catch (SQLException ex) {
        FAILURES.incrementAndGet();
        throw ex;
      }
    }
  }

  public static void main(String[] args) throws Exception {
    String url = env("JDBC_URL", null);
    int set = Integer.parseInt(env("SET", "2"));
    String layout = env("LAYOUT", "expert");
    int streams = Integer.parseInt(env("STREAMS", "3000"));
    int perStream = Integer.parseInt(env("PER_STREAM", "10"));
    int customers = Integer.parseInt(env("CUSTOMERS", "100"));
    int batch = Integer.parseInt(env("BATCH", "100"));
    int timeout = Integer.parseInt(env("TIMEOUT", "90"));
    String schema = env("AXON_SCHEMA", "axon_bench");
    if (url == null || !(layout.equals("recommended") || layout.equals("expert"))) {
      System.err.println("usage: JDBC_URL=jdbc:postgresql://... [SET=0|1|2] [LAYOUT=recommended|expert] [BATCH=100] java bench.AxonCrossStream");
      System.exit(2);
    }

    // A warm-up drain of the same size first, in a schema of its own: a service's JVM has
    // compiled its hot paths long before a backlog arrives (measured: the same drain at about
    // 6 000 applies/s in a fresh JVM against 9 000 with C1 alone).
    try {
      if (!env("WARMUP", "1").equals("0")) {
        drain(url, schema + "_warmup", set, layout, streams, perStream, customers, batch, timeout);
      }
      System.out.println(drain(url, schema, set, layout, streams, perStream, customers, batch, timeout));
      System.exit(0);
    } catch (Exception e) {
      e.printStackTrace();
      System.exit(1); // the processors' threads would keep the JVM alive
    }
  }

  /** One drain in a fresh schema; returns its line. */
  static String drain(String url, String schema, int set, String layout, int streams, int perStream, int customers, int batch,
      int timeout) throws Exception {
    HikariConfig hc = new HikariConfig();
    hc.setJdbcUrl(url);
    hc.setMaximumPoolSize(1);
    try (HikariDataSource ds = new HikariDataSource(hc);
        Connection c = ds.getConnection();
        Statement s = c.createStatement()) {
      s.execute("DROP SCHEMA IF EXISTS " + schema + " CASCADE");
      s.execute("CREATE SCHEMA " + schema);
    }
    hc = new HikariConfig();
    hc.setJdbcUrl(url);
    hc.setSchema(schema);
    hc.setMaximumPoolSize(Integer.parseInt(env("POOL", "32")));
    try (HikariDataSource ds = new HikariDataSource(hc)) {
      return run(ds, set, layout, streams, perStream, customers, batch, timeout);
    }
  }

  static String run(HikariDataSource ds, int set, String layout, int streams, int perStream, int customers, int batch, int timeout)
      throws Exception {
    ConnectionProvider connections = new UnitOfWorkAwareConnectionProviderWrapper(new DataSourceConnectionProvider(ds));
    JacksonSerializer serializer = JacksonSerializer.defaultSerializer();
    JdbcEventStorageEngine engine = JdbcEventStorageEngine.builder()
        .connectionProvider(connections)
        .transactionManager(NoTransactionManager.INSTANCE)
        .eventSerializer(serializer)
        .snapshotSerializer(serializer)
        .batchSize(Integer.parseInt(env("READ_BATCH", "1000")))
        .build();
    EmbeddedEventStore store = EmbeddedEventStore.builder().storageEngine(engine)
        .fetchDelay(Long.parseLong(env("FETCH_DELAY_MS", "1000"))).build();
    JdbcTokenStore tokens = JdbcTokenStore.builder().connectionProvider(connections).serializer(serializer).build();
    // Axon's own PostgreSQL tables (createSchema would swallow an error).
    try (Connection c = ds.getConnection()) {
      PostgresEventTableFactory.INSTANCE.createDomainEventTable(c, EventSchema.builder().build()).execute();
      PostgresEventTableFactory.INSTANCE.createSnapshotEventTable(c, EventSchema.builder().build()).execute();
      PostgresTokenTableFactory.INSTANCE.createTable(c, TokenSchema.builder().build()).execute();
    }

    boolean expert = layout.equals("expert");
    List<Perspective> all = List.of(
        new Perspective("orders",
            "CREATE TABLE orders (order_id text PRIMARY KEY, customer text NOT NULL, lines bigint NOT NULL, total numeric NOT NULL)",
            "INSERT INTO orders AS o VALUES (?, ?, 1, ?) ON CONFLICT (order_id) DO UPDATE SET lines = o.lines + 1, total = o.total + excluded.total",
            SequentialPerAggregatePolicy.instance(), 4),
        new Perspective("customer_stats",
            "CREATE TABLE customer_stats (customer text PRIMARY KEY, lines bigint NOT NULL, total numeric NOT NULL)",
            "INSERT INTO customer_stats AS c VALUES (?, 1, ?) ON CONFLICT (customer) DO UPDATE SET lines = c.lines + 1, total = c.total + excluded.total",
            expert
                ? PropertySequencingPolicy.builder(OrderLine.class, String.class).propertyExtractor(OrderLine::getCustomer).build()
                : SequentialPerAggregatePolicy.instance(),
            4),
        new Perspective("global_stats",
            "CREATE TABLE global_stats (id int PRIMARY KEY, lines bigint NOT NULL)",
            "INSERT INTO global_stats AS g VALUES (1, 1) ON CONFLICT (id) DO UPDATE SET lines = g.lines + 1",
            expert ? new SequentialPolicy() : SequentialPerAggregatePolicy.instance(),
            expert ? 1 : 4));
    List<Perspective> chosen = all.subList(0, set + 1);
    try (Connection c = ds.getConnection(); Statement s = c.createStatement()) {
      for (Perspective p : chosen) {
        s.execute(p.setup());
      }
    }

    boolean tracking = env("PROCESSOR", "pooled").equals("tracking");
    List<StreamingEventProcessor> processors = new ArrayList<>();
    for (Perspective p : chosen) {
      SimpleEventHandlerInvoker invoker = SimpleEventHandlerInvoker.builder()
          .eventHandlers(new Handler(connections, p))
          .sequencingPolicy(p.policy())
          .build();
      StreamingEventProcessor processor = tracking
          ? TrackingEventProcessor.builder()
              .name(p.name())
              .eventHandlerInvoker(invoker)
              .messageSource(store)
              .tokenStore(tokens)
              .transactionManager(NoTransactionManager.INSTANCE)
              .trackingEventProcessorConfiguration(TrackingEventProcessorConfiguration
                  .forParallelProcessing(p.segments())
                  .andInitialSegmentsCount(p.segments())
                  .andBatchSize(batch))
              .build()
          : PooledStreamingEventProcessor.builder()
              .name(p.name())
              .eventHandlerInvoker(invoker)
              .messageSource(store)
              .tokenStore(tokens)
              .transactionManager(NoTransactionManager.INSTANCE)
              .coordinatorExecutor(Executors.newSingleThreadScheduledExecutor())
              .workerExecutor(Executors.newScheduledThreadPool(4))
              .initialSegmentCount(p.segments())
              .batchSize(batch)
              .build();
      processor.start();
      processors.add(processor);
    }
    awaitClaimed(ds, chosen);

    long deadlocks0 = deadlocks(ds);
    // The backlog in one transaction, as the engine's benchmark appends it.
    List<DomainEventMessage<?>> events = new ArrayList<>(streams * perStream);
    for (int s = 1; s <= streams; s++) {
      String id = String.format("00000000-0000-7000-8000-%012x", s);
      for (int v = 1; v <= perStream; v++) {
        events.add(new GenericDomainEventMessage<>("Order", id, v - 1, new OrderLine("c" + (s % customers), v)));
      }
    }
    // Published through the event store, which tells its open streams when the commit is done.
    DefaultUnitOfWork.startAndGet(null).execute(() -> store.publish(events));
    long t0 = System.nanoTime();
    long total = (long) streams * perStream;
    boolean drained = awaitDrained(ds, chosen, total, timeout);
    long t1 = System.nanoTime();
    long deadlocks = deadlocks(ds) - deadlocks0;
    for (StreamingEventProcessor p : processors) {
      p.shutDown();
    }
    String exact = exactness(ds, chosen, streams, perStream, customers);
    double rate = total * chosen.size() / ((t1 - t0) / 1e9);
    long failures = FAILURES.getAndSet(0);
    return String.format("%.0f %d %d %s %s", rate, deadlocks, failures, exact, drained ? "drained" : "timeout");
  }

  /** Waits until every processor claimed all of its segments, so the timing starts warm. */
  static void awaitClaimed(HikariDataSource ds, List<Perspective> chosen) throws Exception {
    int want = chosen.stream().mapToInt(Perspective::segments).sum();
    for (int i = 0; i < 600; i++) {
      try (Connection c = ds.getConnection(); Statement s = c.createStatement();
          ResultSet r = s.executeQuery("SELECT count(*) FROM tokenentry WHERE owner IS NOT NULL")) {
        r.next();
        if (r.getInt(1) >= want) {
          return;
        }
      }
      Thread.sleep(50);
    }
    throw new IllegalStateException("the processors did not claim their " + want + " segments in 30 s");
  }

  static boolean awaitDrained(HikariDataSource ds, List<Perspective> chosen, long total, int timeout) throws Exception {
    StringBuilder q = new StringBuilder("SELECT (SELECT coalesce(sum(lines), 0) FROM orders) = " + total);
    if (chosen.size() > 1) {
      q.append(" AND (SELECT coalesce(sum(lines), 0) FROM customer_stats) = ").append(total);
    }
    if (chosen.size() > 2) {
      q.append(" AND (SELECT coalesce(sum(lines), 0) FROM global_stats) = ").append(total);
    }
    long deadline = System.nanoTime() + timeout * 1_000_000_000L;
    try (Connection c = ds.getConnection(); PreparedStatement s = c.prepareStatement(q.toString())) {
      while (System.nanoTime() < deadline) {
        try (ResultSet r = s.executeQuery()) {
          r.next();
          if (r.getBoolean(1)) {
            return true;
          }
        }
        Thread.sleep(10);
      }
    }
    return false;
  }

  static long deadlocks(HikariDataSource ds) throws SQLException {
    try (Connection c = ds.getConnection(); Statement s = c.createStatement();
        ResultSet r = s.executeQuery("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")) {
      r.next();
      return r.getLong(1);
    }
  }

  /** "exact" when every row holds what the events say, else the first model that differs. */
  static String exactness(HikariDataSource ds, List<Perspective> chosen, int streams, int perStream, int customers)
      throws SQLException {
    long lineTotal = (long) perStream * (perStream + 1) / 2;
    String[] checks = {
      "SELECT count(*) FROM orders o FULL JOIN (SELECT format('00000000-0000-7000-8000-%s', lpad(to_hex(s), 12, '0')) id,"
          + " 'c' || (s % " + customers + ") customer FROM generate_series(1, " + streams + ") s) e ON e.id = o.order_id"
          + " WHERE o.lines IS DISTINCT FROM " + perStream + " OR o.total IS DISTINCT FROM " + lineTotal
          + " OR o.customer IS DISTINCT FROM e.customer",
      "SELECT count(*) FROM customer_stats x FULL JOIN (SELECT 'c' || (s % " + customers + ") customer, count(*) n"
          + " FROM generate_series(1, " + streams + ") s GROUP BY 1) e ON e.customer = x.customer"
          + " WHERE x.lines IS DISTINCT FROM e.n * " + perStream + " OR x.total IS DISTINCT FROM e.n * " + lineTotal,
      "SELECT CASE WHEN (SELECT lines FROM global_stats WHERE id = 1) = " + (long) streams * perStream + " THEN 0 ELSE 1 END",
    };
    try (Connection c = ds.getConnection(); Statement s = c.createStatement()) {
      for (int i = 0; i < chosen.size(); i++) {
        try (ResultSet r = s.executeQuery(checks[i])) {
          r.next();
          if (r.getLong(1) != 0) {
            return "WRONG:" + chosen.get(i).name();
          }
        }
      }
    }
    return "exact";
  }

  static String env(String name, String fallback) {
    String v = System.getenv(name);
    return v == null || v.isEmpty() ? fallback : v;
  }
}
